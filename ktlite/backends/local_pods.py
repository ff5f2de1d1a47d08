"""A local pod: a ``python -m ktlite_server`` process on this machine, as the local backend
starts it (its command line, environment and secrets, its memory limit, the GPUs it gets),
waits for it to come up, and stops it.

Its server writes its port to a ready file once it listens; the token reaches it on stdin,
never in its environment or command line. Mixed into
:class:`~ktlite.backends.local.LocalBackend`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ktlite.specs.secrets as kt_secrets
from ktlite.backends import local_volumes
from ktlite.backends.local_cgroups import memory_cgroup, remove_cgroup
from ktlite.backends.local_scaling import LAUNCH_FILE
from ktlite.backends.local_volumes import LocalVolume
from ktlite.backends.processes import pid_alive
from ktlite.config import home as store_home
from ktlite.errors import ConfigError, LaunchTimeout, StartupError
from ktlite.logconfig import pod_env
from ktlite.net.connection import Pool
from ktlite.net.progress import StatusLine
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire.headers import TOKEN_HEADER, bearer

_gpu_cache: list[str] | None = None


def visible_gpus() -> list[str]:
    """GPU ids this machine offers: CUDA_VISIBLE_DEVICES, else ``nvidia-smi -L``, else none."""
    global _gpu_cache
    if _gpu_cache is None:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env is not None:
            _gpu_cache = [d for d in env.split(",") if d.strip() and d.strip() != "-1"]
        elif shutil.which("nvidia-smi"):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10
                ).stdout
                _gpu_cache = [
                    str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")
                ]
            except (OSError, subprocess.SubprocessError):
                _gpu_cache = []
        else:
            _gpu_cache = []
    return _gpu_cache


def answers(url: str, context: ssl.SSLContext | None = None, timeout: float = 2.0) -> bool:
    """Whether a local pod's server at ``url`` answers GET /health (over TLS pinned with
    ``context`` for an ``https://`` pod)."""
    pool = Pool()
    try:
        status, _, _ = pool.fetch("GET", url, "/health", {}, [], timeout, timeout, context)
    except OSError:  # refused, closed, timed out, or not the pinned certificate
        return False
    finally:
        pool.close()
    return status == 200


def idleness(port: int, token: str, timeout: float = 2.0) -> dict[str, float | None]:
    """``idle_s`` and ``ttl_s`` (its inactivity_ttl) as a local pod's server reports them on
    ``GET /health`` (``ktlite list``'s IDLE and DEADLINE); nothing for a server without a
    TTL (as on Kubernetes), None where it does not answer."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health", headers={TOKEN_HEADER: bearer(token)})
        resp = conn.getresponse()
        body = json.loads(resp.read()) if resp.status == 200 else {}
    except (OSError, http.client.HTTPException, ValueError):
        body = {}
    finally:
        conn.close()
    if body and body.get("inactivity_ttl") is None:
        return {}
    return {"idle_s": body.get("idle_s"), "ttl_s": body.get("inactivity_ttl")}


def _tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join("    " + ln for ln in text.splitlines()[-lines:])


class LocalPods:
    """Starting, waiting for and stopping local pod processes (mixed into the local backend)."""

    name: str
    _procs: dict[int, subprocess.Popen[bytes]]  # the pods this process started, by pid

    if TYPE_CHECKING:  # the local backend's, which this is mixed into

        def _dir(self, name: str) -> Path: ...

        def encrypts(self, spec: DeploymentSpec) -> bool: ...

    def _command(
        self, spec: DeploymentSpec, ordinal: int, ready: Path, mounted: list[LocalVolume]
    ) -> list[str]:
        # an autoscaled deployment's replicas are each rank 0 of a world of their own
        served = spec.autoscale is not None
        cmd = [
            sys.executable,
            "-m",
            "ktlite_server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--token-stdin",
            "--pod",
            f"{spec.name}-{ordinal}",
            "--ordinal",
            "0" if served else str(ordinal),
            "--procs",
            str(spec.distributed.procs(ordinal)),
            "--ready-file",
            str(ready),
        ]
        if not spec.detached:
            cmd += ["--parent-pid", str(os.getpid())]
        if self.encrypts(spec):  # certificate and key on stdin, after the token
            cmd.append("--tls-stdin")
        ttl = spec.pod.calls.inactivity_seconds
        if ttl is not None:
            cmd += ["--inactivity-ttl", f"{ttl:g}"]
        if mounted:  # the same process, in a mount namespace of its own: see ktlite_server.mountns
            cmd = local_volumes.wrap(
                cmd, [(v.source, v.mount_path) for v in mounted], self._dir(spec.name) / "root"
            )
        return cmd

    def _env(
        self,
        spec: DeploymentSpec,
        ordinal: int,
        volumes: list[LocalVolume] | None = None,
        mounted: bool = False,
        secret_env: dict[str, str] | None = None,
    ) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")} | pod_env()
        image = spec.pod.image
        if image is not None:
            env.update(image.env)
        env.update(spec.pod.env)
        env.update(secret_env or {})
        first = sum(spec.pod.pod_gpus(i) for i in range(ordinal))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            visible_gpus()[first : first + spec.pod.pod_gpus(ordinal)]
        )
        env["KTLITE_POD_ORDINAL"] = "0" if spec.autoscale is not None else str(ordinal)
        if spec.autoscale is not None:  # a replica started later loads the current code at boot
            env["KTLITE_LAUNCH_FILE"] = str(self._dir(spec.name) / LAUNCH_FILE)
        env["KTLITE_DEPLOYMENT"] = spec.name
        env["KTLITE_BACKEND"] = "local"
        env["KTLITE_STORE_HOME"] = str(store_home())  # kt.put/get in the ranks: the caller's store
        if spec.pod.kubernetes.namespace:
            env["KTLITE_STORE_NAMESPACE"] = spec.pod.kubernetes.namespace
        env["PYTHONUNBUFFERED"] = "1"
        for vol in reversed(volumes or []):  # the first mount of a volume wins
            env[vol.env_name] = vol.mount_path if mounted else str(vol.source)
        return env

    def _secrets(self, spec: DeploymentSpec) -> list[kt_secrets.Resolved]:
        """The Compute's secrets, read; there are no Kubernetes Secrets to reuse here."""
        return kt_secrets.for_pod(spec.pod.secrets, spec.pod.merged_env, self.name)

    def _secret_env(
        self, spec: DeploymentSpec, resolved: list[kt_secrets.Resolved]
    ) -> dict[str, str]:
        """Write the file secrets into the deployment's own dir; the env vars ranks get."""
        env = {k: v for r in resolved for k, v in r.env.items()}
        if any(r.files for r in resolved):
            env.update(kt_secrets.write_files(resolved, self._dir(spec.name) / "secrets"))
        return env

    def _check_gpus(self, spec: DeploymentSpec) -> None:
        per_pod = [spec.pod.pod_gpus(i) for i in range(spec.workers)]
        want = sum(per_pod)
        have = len(visible_gpus())
        if want > have:
            shape = (
                f"gpus={spec.pod.resources.gpus} × workers={spec.workers}"
                if len(set(per_pod)) == 1
                else f"pods of {per_pod} GPUs (one per rank)"
            )
            raise ConfigError(
                f"{shape} needs {want} GPU(s), "
                f"but this machine has {have}; lower gpus/workers, or use "
                "backend='kubernetes' to run on a cluster"
            )

    def _limit_memory(
        self, spec: DeploymentSpec, ordinal: int, proc: subprocess.Popen[bytes]
    ) -> str | None:
        """Put the pod (and the rank processes it will start) under ``memory_limit``."""
        limit = spec.pod.resources.memory_limit
        if limit is None:
            return None
        group = memory_cgroup(f"{spec.name}-{ordinal}-{proc.pid}", limit.bytes)
        if group is None:
            logging.getLogger(__name__).warning(
                "memory_limit=%r is not enforced for local pod %s-%d: this machine "
                "does not let ktlite create memory cgroups",
                limit.quantity,
                spec.name,
                ordinal,
            )
            return None
        try:
            (group / "cgroup.procs").write_text(str(proc.pid))
        except OSError:
            remove_cgroup(str(group))
            return None
        return str(group)

    def _wait_ready(
        self,
        spec: DeploymentSpec,
        ordinal: int,
        proc: subprocess.Popen[bytes],
        ready: Path,
        log: Path,
        deadline: float,
        progress: str,
        line: StatusLine,
    ) -> int:
        timeout = spec.pod.calls.launch_timeout
        while time.monotonic() < deadline:
            line.tick()
            code = proc.poll()
            if code is not None:
                raise StartupError(
                    f"pod {spec.name}-{ordinal} exited with code {code} while starting; "
                    f"last lines of {log}:\n{_tail(log)}"
                )
            try:
                with open(ready) as f:
                    return int(json.load(f)["port"])
            except (OSError, ValueError, KeyError):
                time.sleep(0.01)
        raise LaunchTimeout(
            f"pod {spec.name}-{ordinal} was not ready after launch_timeout={timeout:g}s "
            f"({progress}): the process is running but its server never came up; last "
            f"lines of {log}:\n{_tail(log)}\nraise launch_timeout, or check the log"
        )

    def _stop_pods(self, pods: list[dict[str, Any]], timeout: float) -> None:
        pids = [p["pid"] for p in pods if p.get("pid")]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for pid in pids:
            proc = self._procs.pop(pid, None)
            while time.monotonic() < deadline:
                if proc is not None and proc.poll() is not None:
                    break
                if proc is None and not pid_alive(pid):
                    break
                time.sleep(0.01)
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(2.0)
        for pod in pods:
            remove_cgroup(pod.get("cgroup"))
