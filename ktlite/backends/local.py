"""The embedded local backend: a pod is a ``python -m ktlite_server`` process on this machine.

Each deployment keeps its state in ``$KTLITE_HOME/local/<name>/`` (default ``~/.ktlite``):
``state.json`` (mode 0600: it holds the token), one log file per pod, and the files of its
file secrets under ``secrets/`` (mode 0700; each file 0600) laid out as under a home
(``secrets/.aws/credentials``), with the provider's variable pointing at each
(``AWS_SHARED_CREDENTIALS_FILE``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``KUBECONFIG``). Pods of a normal
deployment watch the Python process that created them and exit with it; a detached
deployment lives until ``teardown``. A pod's process is :mod:`~ktlite.backends.local_pods`';
volumes are directories that outlive it (``local_volumes``); the Compute fields only
Kubernetes acts on get one warning per deployment (``kube_only``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import random
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import ktlite.specs.secrets as kt_secrets
from ktlite.backends import local_volumes
from ktlite.backends.base import Applied, Backend, Plan, PodEndpoint, read_state, write_state
from ktlite.backends.kube_only import unused_fields, warn_unused
from ktlite.backends.local_pods import LocalPods, answers, idleness
from ktlite.backends.local_scaling import LAUNCH_FILE, LocalScaling
from ktlite.backends.local_volumes import LocalVolume
from ktlite.backends.processes import pid_alive
from ktlite.config import home as config_home
from ktlite.config import private_dir
from ktlite.errors import DeployError
from ktlite.net import tls
from ktlite.net.progress import StatusLine
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire import privatefiles
from ktlite_wire.distenv import port_free


def _home() -> Path:
    return config_home() / "local"


# Below Linux's ephemeral range (32768+): bind(0) there hands the same few ports out again
# and again, and two deployments sharing a MASTER_PORT would join each other's rendezvous.
_PORT_RANGE = (20000, 32000)


def _master_port(taken: set[int], span: int) -> int:
    """A MASTER_PORT no other local deployment uses, with ``span`` free ports after it
    (process groups, TF_CONFIG's port per rank, Ray's nodes: ``DistributedConfig.port_span``)."""
    low, high = _PORT_RANGE[0], _PORT_RANGE[1] - max(span, 1)
    start = random.SystemRandom().randrange(low, high)
    for port in (*range(start, high), *range(low, start)):  # random start, then every port
        ports = range(port, port + max(span, 1))
        if not taken.intersection(ports) and all(port_free(p) for p in ports):
            return int(port)
    raise DeployError(
        f"found no free MASTER_PORT in {_PORT_RANGE[0]}-{_PORT_RANGE[1]}; pass distribute(port=...)"
    )


class LocalBackend(LocalPods, LocalScaling, Backend):
    name = "local"
    tls_default = False  # loopback only; Compute(tls=True) asks for it

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._owned: set[str] = set()
        self._lock = threading.RLock()
        self._warned: set[tuple[str, str]] = set()  # (deployment, what it was told)
        self._leads: dict[str, int] = {}  # autoscaler locks this process holds, by deployment
        atexit.register(self._atexit)

    # ---- state ------------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        return _home() / name

    def _read(self, name: str) -> dict[str, Any] | None:
        return read_state(self._dir(name))

    def _write(self, name: str, state: dict[str, Any]) -> None:
        write_state(self._dir(name), state)

    def _live_state(self, name: str) -> dict[str, Any] | None:
        state = self._read(name)
        if state is None:
            return None
        owner_gone = not state.get("detached") and not pid_alive(state.get("owner_pid"))
        # an autoscaled deployment may run no replica at all (scaled to zero)
        all_dead = not any(pid_alive(p["pid"]) for p in state["pods"]) and (
            bool(state["pods"]) or not state.get("autoscaled")
        )
        if owner_gone or all_dead:
            self._stop_pods(state["pods"], timeout=2.0)
            shutil.rmtree(self._dir(name), ignore_errors=True)
            return None
        return state

    # ---- backend API ------------------------------------------------------------------

    def _volumes(self, spec: DeploymentSpec) -> tuple[list[LocalVolume], bool]:
        """The deployment's volumes, and whether its pods get them at their mount paths."""
        volumes = local_volumes.local_volumes(spec.pod)
        return volumes, bool(volumes) and local_volumes.mounts_available()[0]

    def _warn_unused(self, spec: DeploymentSpec, volumes: list[LocalVolume], mounted: bool) -> None:
        """One warning per deployment (and process) naming what does nothing locally."""
        fields = unused_fields(spec.pod, spec.workers)
        notes = []
        if volumes and not mounted:
            fields.append("volumes")
            where = ", ".join(
                f"{v.name!r} ({v.mount_path}) is the directory {v.source}, in the pods' "
                f"environment as ${v.env_name}"
                for v in volumes
            )
            notes.append(
                f"volumes are not mounted at their mount_path ({local_volumes.mounts_available()[1]}): "
                f"{where}"
            )
        if not fields:
            return
        key = (spec.name, ",".join(fields))
        if key not in self._warned:
            self._warned.add(key)
            warn_unused(spec.name, fields, notes)

    def plan(self, spec: DeploymentSpec) -> Plan:
        self._check_gpus(spec)
        resolved = self._secrets(spec)
        cmds = [
            f"# secret {r.key!r}: write {r.placeholders()[f.key]} to "
            f"{self._dir(spec.name) / 'secrets' / f.pod_path} (0600)"
            + (f"; {f.pointer} names it" if f.pointer else "")
            for r in resolved
            for f in r.files
        ]
        volumes, mounted = self._volumes(spec)
        shipped = "echo <token>"
        if self.encrypts(spec):  # the certificate and key follow the token on stdin
            shipped = f"(echo <token>; echo {shlex.quote(tls.SHIPPED_PLACEHOLDER)})"
        if spec.autoscale is not None:
            cmds.append(
                f"# autoscaled: {spec.autoscale.describe()}; ktlite's autoscaler in the calling process "
                f"starts and stops replicas like these; each loads {self._dir(spec.name) / LAUNCH_FILE} "
                "(KTLITE_LAUNCH_FILE) at boot"
            )
        for i in range(spec.workers):
            keys = sorted([*spec.pod.env, *(k for r in resolved for k in r.env)])
            prefix = " ".join(f"{k}=..." for k in keys)
            ready = self._dir(spec.name) / f"pod-{i}.ready"
            cmds.append(
                f"cd {shlex.quote(str(self._dir(spec.name)))} && {shipped} | KTLITE_WORKDIR="
                f"{shlex.quote(os.getcwd())} "
                + (prefix + " " if prefix else "")
                + shlex.join(self._command(spec, i, ready, volumes if mounted else []))
            )
        return Plan(backend=self.name, name=spec.name, commands=cmds)

    def apply(self, spec: DeploymentSpec, token: str) -> Applied:
        self._check_gpus(spec)
        resolved = self._secrets(spec)  # a preset that finds nothing fails before any pod starts
        volumes, mounted = self._volumes(spec)
        self._warn_unused(spec, volumes, mounted)
        secure = self.encrypts(spec)
        with self._lock:
            state = self._live_state(spec.name)
            if state is not None and state.get("token") != token:
                raise DeployError(
                    f"deployment {spec.name!r} exists with another token; tear it down first"
                )
            pod_hash = spec.pod_hash()
            # pods restart when a secret's value changes (the digest tells nothing of it)
            if resolved:
                pod_hash += "-" + kt_secrets.fingerprint(resolved, token)
            secret_env = self._secret_env(spec, resolved)
            # the ranks' working directory: the caller's (an autoscaled deployment's replicas all
            # get the first one's); pod servers start in the deployment's own directory, where
            # no file of the caller's can shadow ktlite (``python -m`` imports from its cwd first)
            workdir = (
                (state or {}).get("workdir") if spec.autoscale is not None else None
            ) or os.getcwd()
            old_pods = {p["ordinal"]: p for p in (state or {}).get("pods", [])}
            pods: list[dict[str, Any]] = []
            starting: list[tuple[int, subprocess.Popen[bytes], Path, Path, str | None]] = []
            private_dir("local", spec.name)
            local_volumes.prepare(volumes, owner=spec.name)
            if mounted:
                # where each pod builds its root
                privatefiles.make_dir(self._dir(spec.name) / "root")
            for i in range(spec.workers):
                old = old_pods.pop(i, None)
                # reuse a pod only if it answers: a killed one can look alive for a few ms,
                # a stopped or hung one for ever
                if (
                    old
                    and old["hash"] == pod_hash
                    and pid_alive(old["pid"])
                    and answers(
                        f"{'https' if secure else 'http'}://127.0.0.1:{old['port']}",
                        tls.pinned_context(token) if secure else None,
                    )
                ):
                    pods.append(old)
                    continue
                if old:
                    self._stop_pods([old], timeout=5.0)
                ready = self._dir(spec.name) / f"pod-{i}.ready"
                log = self._dir(spec.name) / f"pod-{i}.log"
                with contextlib.suppress(FileNotFoundError):
                    ready.unlink()
                with privatefiles.open_append(log) as logf:
                    proc = subprocess.Popen(
                        self._command(spec, i, ready, volumes if mounted else []),
                        env={
                            **self._env(spec, i, volumes, mounted, secret_env),
                            "KTLITE_WORKDIR": workdir,
                        },
                        stdin=subprocess.PIPE,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        cwd=self._dir(spec.name),
                    )
                assert proc.stdin is not None
                # the token (and TLS key) go through a pipe, never env or argv
                with contextlib.suppress(OSError):
                    proc.stdin.write(
                        token.encode()
                        + b"\n"
                        + (tls.identity(token).stdin_line() if secure else b"")
                    )
                    proc.stdin.close()
                self._procs[proc.pid] = proc
                cgroup = self._limit_memory(spec, i, proc)
                starting.append((i, proc, ready, log, cgroup))
            span = spec.distributed.port_span
            kept = (
                (state or {}).get("master_port")
                if (state or {}).get("port_span", 0) >= span
                else None
            )
            master_port = (
                spec.distributed.port or kept or _master_port(self._ports_in_use(spec.name), span)
            )
            deadline = time.monotonic() + spec.pod.calls.launch_timeout  # one deadline for all pods
            line = StatusLine(spec.name)
            try:
                for i, proc, ready, log, cgroup in starting:
                    ready_names = ", ".join(p["name"] for p in pods) or "none"
                    line.update(f"starting pods, {len(pods)}/{len(starting)} ready")
                    port = self._wait_ready(
                        spec,
                        i,
                        proc,
                        ready,
                        log,
                        deadline,
                        f"{len(pods)} of {spec.workers} pods were ready: {ready_names}",
                        line,
                    )
                    pods.append(
                        {
                            "ordinal": i,
                            "name": f"{spec.name}-{i}",
                            "pid": proc.pid,
                            "port": port,
                            "hash": pod_hash,
                            "cgroup": cgroup,
                        }
                    )
            except BaseException:
                line.done("failed")
                self._stop_pods(
                    [{"pid": p.pid, "cgroup": c} for _, p, _, _, c in starting], timeout=2.0
                )
                raise
            line.done(f"{len(starting)} pod(s) ready")
            pods.sort(key=lambda p: p["ordinal"])
            state = {
                "name": spec.name,
                "detached": spec.detached,
                "owner_pid": os.getpid(),
                "autoscaled": spec.autoscale is not None,
                "autoscale": asdict(spec.autoscale) if spec.autoscale is not None else None,
                "master_port": master_port,
                "port_span": span,
                "token": token,
                "tls": secure,
                "pods": pods,
                "workdir": workdir,
                "created": (state or {}).get("created", time.time()),
            }
            self._write(spec.name, state)
            # ordinals beyond workers stop only once the state no longer lists them: another
            # process reading it meanwhile took a deployment whose pods were all dead for gone
            self._stop_pods(list(old_pods.values()), timeout=5.0)
            if spec.autoscale is not None:  # what scale() starts more replicas of
                privatefiles.write_file(
                    self._dir(spec.name) / "spec.pkl", pickle.dumps(replace(spec, replicas=None))
                )
            if not spec.detached:
                self._owned.add(spec.name)
            applied = self._applied(state)
            applied.restarted = [i for i, *_ in starting]
            return applied

    def _applied(self, state: dict[str, Any]) -> Applied:
        scheme = "https" if state.get("tls") else "http"
        eps = [
            PodEndpoint(
                name=p["name"],
                ordinal=p["ordinal"],
                url=f"{scheme}://127.0.0.1:{p['port']}",
                peer_url=f"{scheme}://127.0.0.1:{p['port']}",
                ip="127.0.0.1",
                incarnation=str(p["pid"]),
            )
            for p in state["pods"]
        ]
        return Applied(
            name=state["name"],
            backend=self.name,
            endpoints=eps,
            token=state["token"],
            master_port=state["master_port"],
            same_host=True,
            autoscale=state.get("autoscale"),
            spec_hash=str(state["pods"][0].get("hash", "")) if state["pods"] else "",
        )

    def _ports_in_use(self, except_name: str) -> set[int]:
        """MASTER_PORT ranges of the other live local deployments."""
        taken: set[int] = set()
        home = _home()
        if home.is_dir():
            for d in home.iterdir():
                state = self._read(d.name) if d.name != except_name else None
                if state and state.get("master_port"):
                    port = int(state["master_port"])
                    taken.update(
                        range(
                            port, port + int(state.get("port_span") or len(state["pods"]) * 8 + 1)
                        )
                    )
        return taken

    def lookup(self, name: str) -> Applied | None:
        state = self._live_state(name)
        if state is None:
            return None
        # a pod whose server died is gone from the deployment, as a deleted pod is on a
        # cluster: the next call (or .to()) starts it again and pushes the code
        return self._applied({**state, "pods": [p for p in state["pods"] if pid_alive(p["pid"])]})

    def teardown(self, name: str, timeout: float = 30.0, volumes: bool = False) -> bool:
        with self._lock:
            self._stop_supervisor(name, timeout=min(timeout, 10.0))
            state = self._read(name)
            self._owned.discard(name)
            if name in self._leads:
                with contextlib.suppress(OSError):
                    os.close(self._leads.pop(name))
            if state is not None:
                self._stop_pods(state["pods"], timeout=timeout)
                shutil.rmtree(self._dir(name), ignore_errors=True)
            deleted = local_volumes.delete_owned(name) if volumes else []
            return state is not None or bool(deleted)

    def list(self) -> list[dict[str, Any]]:
        home = _home()
        out = []
        if home.is_dir():
            for d in sorted(home.iterdir()):
                state = self._live_state(d.name)
                if state is None:
                    continue
                alive = sum(pid_alive(p["pid"]) for p in state["pods"])
                head = next((p for p in state["pods"] if p["ordinal"] == 0), None)
                live = head is not None and pid_alive(head["pid"])
                out.append(
                    {
                        **(idleness(head["port"], state["token"]) if head and live else {}),
                        "name": state["name"],
                        "backend": self.name,
                        "namespace": None,
                        "pods": len(state["pods"]),
                        "ready": alive,
                        "detached": state["detached"],
                        "autoscaled": bool(state.get("autoscaled")),
                    }
                )
        return out

    def logs(
        self, name: str, ordinal: int | None = None, follow: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        state = self._live_state(name)
        if state is None:
            raise DeployError(f"no local deployment {name!r}")
        pods = [p for p in state["pods"] if ordinal is None or p["ordinal"] == ordinal]
        if not pods:
            raise DeployError(
                f"no pod {ordinal} of local deployment {name!r}; it has pods "
                f"0-{len(state['pods']) - 1}"
            )
        offsets = {}
        for pod in pods:
            path = self._dir(name) / f"pod-{pod['ordinal']}.log"
            with contextlib.suppress(OSError), open(path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
                offsets[path] = f.tell()
                for line in lines[-tail:] if tail else lines:
                    yield f"[{pod['name']}] {line}"
        while follow and self._read(name) is not None:  # until torn down (or Ctrl-C)
            time.sleep(0.2)
            for pod in pods:
                path = self._dir(name) / f"pod-{pod['ordinal']}.log"
                with contextlib.suppress(OSError), open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    chunk = f.read()
                    end = chunk.rfind(b"\n") + 1  # whole lines only
                    offsets[path] = offsets.get(path, 0) + end
                    for line in chunk[:end].decode("utf-8", "replace").splitlines():
                        yield f"[{pod['name']}] {line}"

    def _atexit(self) -> None:
        for name in list(self._owned):
            with contextlib.suppress(Exception):
                self.teardown(name, timeout=3.0)
