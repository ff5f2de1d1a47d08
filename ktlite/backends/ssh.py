"""The ssh backend: a pod is a ktlite server on a machine reached over SSH (``asyncssh``).

``Compute(hosts=[...])`` names the machines, one pod each. At ``.to()`` the client connects to
every host at once (the user's ``~/.ssh/config``, agent and keys; host keys checked against
``known_hosts``), finds a Python at least as new as its own minor version, copies ktlite's
source into a per-user cache (``~/.cache/ktlite``) when that version is missing (over the
SSH connection itself: :mod:`ktlite.backends.ssh_copy`),
and starts the pod server through ``ktlite_server.sshlaunch``: the token and environment go
over the channel, never on a command line (a pod's server: :mod:`ktlite.backends.ssh_pods`). Calls then go straight to the pod servers over
TCP (the protocol of every backend), or through SSH port forwards where a host's port does
not answer (``Hosts(forward=...)``).

A deployment's server stops with its teardown; a non-detached one also when the SSH channel
that started it closes (this process or its connection is gone), and any of them after
``inactivity_ttl`` without a client. State: ``$KTLITE_HOME/ssh/<name>/state.json`` (0600).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import queue
import shlex
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import ktlite.specs.secrets as kt_secrets
from ktlite.backends import ssh_copy
from ktlite.backends import ssh_hosts as sh
from ktlite.backends.base import Applied, Backend, Plan, PodEndpoint, read_state, write_state
from ktlite.backends.processes import pid_alive
from ktlite.backends.ssh_hosts import COMMAND_TIMEOUT_S
from ktlite.backends.ssh_pods import SshPods, pod_scheme
from ktlite.config import home as config_home
from ktlite.errors import ConfigError, DeployError, KtliteError, LaunchTimeout
from ktlite.net.progress import ticking
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.hosts import Host, Hosts


def _home() -> Path:
    return config_home() / "ssh"


class SshBackend(SshPods, Backend):
    name = "ssh"

    def __init__(self) -> None:
        self._loop = sh.Loop()
        # deployment -> its hosts' connections (this process)
        self._live: dict[str, list[sh.HostConnection]] = {}
        self._lock = threading.Lock()
        self._bundle: tuple[str, bytes] | None = None
        self._deps: tuple[str, bytes | None] | None = None  # (key, bundle once built)

    # ---- state --------------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        return _home() / name

    def _read(self, name: str) -> dict[str, Any] | None:
        return read_state(self._dir(name))

    def _write(self, name: str, state: dict[str, Any]) -> None:
        write_state(self._dir(name), state)

    # ---- backend API --------------------------------------------------------------------

    @staticmethod
    def _hosts(spec: DeploymentSpec) -> Hosts:
        hosts = spec.pod.hosts
        if hosts is None:
            raise ConfigError(
                "backend='ssh' needs the machines: Compute(hosts=['gpu1', 'gpu2', ...]), or "
                "once for all: ktlite config set ssh.hosts gpu1,gpu2"
            )
        return hosts

    def _secrets(self, spec: DeploymentSpec) -> list[kt_secrets.Resolved]:
        """The Compute's secrets, read, before anything connects. Env vars and files travel in
        the launch message on the channel's stdin (never argv); files land in the pod's run
        dir (``secrets/``, 0700; files 0600), removed with it."""
        return kt_secrets.for_pod(spec.pod.secrets, spec.pod.merged_env, self.name)

    def plan(self, spec: DeploymentSpec) -> Plan:
        hosts = self._hosts(spec)
        resolved = self._secrets(spec)
        secret_env = _env_of(resolved)
        lines = [
            f"# secret {r.key!r}: {r.placeholders()[f.key]} goes to <run dir>/secrets/{f.pod_path} (0600)"
            + (f"; {f.pointer} names it" if f.pointer else "")
            for r in resolved
            for f in r.files
        ]
        secure = self.encrypts(spec)
        shipped = ", TLS certificate and key" if secure else ""
        tls_arg = " --tls-stdin" if secure else ""
        for i, h in enumerate(hosts.hosts):
            keys = sorted([*spec.pod.env, *secret_env])
            env = " ".join(f"{k}=..." for k in keys)
            lines.append(
                f"ssh {h.address}: python -m ktlite_server.sshlaunch  # token{shipped}"
                f"{', ' + env if env else ''} on stdin; then: python -m ktlite_server --host "
                "<its address> --port 0"
                + tls_arg
                + " "
                + " ".join(shlex.quote(a) for a in self._server_args(spec, i))
            )
        return Plan(backend=self.name, name=spec.name, commands=lines)

    def apply(self, spec: DeploymentSpec, token: str) -> Applied:
        hosts = self._hosts(spec)
        resolved = self._secrets(spec)  # before anything connects
        with self._lock:
            state = self._current(spec.name)
            if state is not None and state.get("token") != token:
                raise DeployError(
                    f"deployment {spec.name!r} exists with another token; tear it down first"
                )
            timeout = spec.pod.calls.launch_timeout
            what = (
                f"starting the pod servers on {len(hosts.hosts)} host(s) (copying ktlite, "
                "and the server's packages where a host lacks them)"
            )
            try:
                with ticking(f"{spec.name} over SSH", what):
                    state = self._loop.run(
                        self._apply(spec, hosts, token, state, resolved), timeout + 30
                    )
            except TimeoutError:
                raise LaunchTimeout(
                    f"deploying {spec.name!r} over SSH took over {timeout:.0f}s (launch_timeout)"
                ) from None
            self._write(spec.name, state)
            applied = self._applied(state)
            applied.restarted = state.pop("_restarted", [])
            return applied

    async def _connect(self, name: str, hosts: Hosts) -> list[sh.HostConnection]:
        live = self._live.get(name)
        if (
            live is not None
            and [h.host for h in live] == list(hosts.hosts)
            and all(h.conn is not None and not h.conn.is_closed() for h in live)
        ):
            return live
        for h in live or []:
            h.close()
        conns = [sh.HostConnection(i, h, hosts) for i, h in enumerate(hosts.hosts)]
        results = await asyncio.gather(*(c.connect() for c in conns), return_exceptions=True)
        errors = [str(r) for r in results if isinstance(r, BaseException)]
        if errors:
            for c in conns:
                if c.conn is not None:
                    c.close()
            raise DeployError("; ".join(errors))
        self._live[name] = conns
        return conns

    async def _apply(
        self,
        spec: DeploymentSpec,
        hosts: Hosts,
        token: str,
        state: dict[str, Any] | None,
        resolved: list[kt_secrets.Resolved],
    ) -> dict[str, Any]:
        conns = await self._connect(spec.name, hosts)
        pod_hash = spec.pod_hash()
        if resolved:  # pods restart when a secret's value changes (the digest tells nothing of it)
            pod_hash += "-" + kt_secrets.fingerprint(resolved, token)
        secret_env = _env_of(resolved)
        secret_files = [
            {"path": f.pod_path, "data": base64.b64encode(f.data).decode(), "pointer": f.pointer}
            for r in resolved
            for f in r.files
        ]
        old = {p["ordinal"]: p for p in (state or {}).get("pods", [])}
        keep = {
            i
            for i, p in old.items()
            if p.get("hash") == pod_hash
            and i < len(conns)
            and await sh.answers(p["address"], p["port"], conns[i])
        }
        # pods whose host or shape changed stop; ordinals beyond the hosts too
        await asyncio.gather(
            *(
                self._stop_pod(
                    conns[i] if i < len(conns) else None, p, spec.pod.calls.teardown_timeout
                )
                for i, p in old.items()
                if i not in keep
            )
        )
        span = spec.distributed.port_span
        # a kept pod 0 keeps its MASTER_PORT; a new one picks a free span on its host
        master_port = spec.distributed.port or (
            (state or {}).get("master_port") if 0 in keep else None
        )
        version, bundle = self._bundle or ssh_copy.source_bundle()
        self._bundle = (version, bundle)
        starting = [c for c in conns if c.index not in keep]
        started = await asyncio.gather(
            *(
                self._start(
                    spec,
                    c,
                    token,
                    version,
                    bundle,
                    pick=span if (c.index == 0 and not master_port) else 0,
                    pod_hash=pod_hash,
                    secret_env=secret_env,
                    secret_files=secret_files,
                    secure=self.encrypts(spec),
                )
                for c in starting
            ),
            return_exceptions=True,
        )
        errors = [
            str(r) if isinstance(r, KtliteError) else f"{c.label}: {type(r).__name__}: {r}"
            for c, r in zip(starting, started, strict=True)
            if isinstance(r, BaseException)
        ]
        pods = {i: old[i] for i in keep}
        for result in started:
            if not isinstance(result, BaseException):
                picked = result.pop("master_port", None)
                master_port = master_port or picked
                pods[result["ordinal"]] = result
        if errors:
            new = [p for i, p in pods.items() if i not in keep]
            await asyncio.gather(*(self._stop_pod(conns[p["ordinal"]], p, 5.0) for p in new))
            raise DeployError("; ".join(errors))
        await asyncio.gather(*(self._reach(conns[i], p, hosts.forward) for i, p in pods.items()))
        return {
            "name": spec.name,
            "detached": spec.detached,
            "owner_pid": os.getpid(),
            "token": token,
            "master_port": master_port,
            "port_span": span,
            "hosts": [h.address for h in hosts.hosts],
            "options": _options(hosts),
            "created": (state or {}).get("created", time.time()),
            "pods": [pods[i] for i in sorted(pods)],
            "_restarted": sorted(set(pods) - keep),
        }

    def _applied(self, state: dict[str, Any]) -> Applied:
        eps = [
            PodEndpoint(
                name=p["name"],
                ordinal=p["ordinal"],
                url=p.get("url") or f"{pod_scheme(p)}://{sh.hostport(p['address'], p['port'])}",
                peer_url=f"{pod_scheme(p)}://{sh.hostport(p['address'], p['port'])}",
                ip=p["address"],
                incarnation=f"{p['pid']}",
            )
            for p in state["pods"]
        ]
        return Applied(
            name=state["name"],
            backend=self.name,
            endpoints=eps,
            token=state["token"],
            master_port=int(state["master_port"]),
            same_host=False,
        )

    def _current(self, name: str) -> dict[str, Any] | None:
        """The deployment's state, or None (and the state dropped) when its servers went with
        the process that started them (not detached: their SSH channels closed)."""
        state = self._read(name)
        if state is None or state.get("detached") or pid_alive(state.get("owner_pid")):
            return state
        if not any(sh.tcp_ok_now(p["address"], p["port"]) for p in state["pods"]):
            self._forget(name)
            return None
        return state

    def _forget(self, name: str) -> None:
        with contextlib.suppress(OSError):
            (self._dir(name) / "state.json").unlink()
        with contextlib.suppress(OSError):
            self._dir(name).rmdir()

    def lookup(self, name: str) -> Applied | None:
        state = self._current(name)
        if state is None:
            return None
        if name not in self._live and any(
            urlsplit(p.get("url", "")).hostname == "127.0.0.1"
            and p["address"] not in ("127.0.0.1", "localhost")
            for p in state["pods"]
        ):
            # forwarded pods: this process needs its own forwards
            hosts = _hosts_from_state(state)
            try:
                state = self._loop.run(self._rereach(name, hosts, state), 60)
            except (DeployError, TimeoutError):
                return None
        return self._applied(state)

    async def _rereach(self, name: str, hosts: Hosts, state: dict[str, Any]) -> dict[str, Any]:
        conns = await self._connect(name, hosts)
        await asyncio.gather(
            *(self._reach(conns[p["ordinal"]], p, hosts.forward) for p in state["pods"])
        )
        return state

    def teardown(self, name: str, timeout: float = 30.0, volumes: bool = False) -> bool:
        state = self._read(name)
        if state is None:
            return False
        hosts = _hosts_from_state(state)

        async def stop() -> None:
            conns = await self._connect(name, hosts)
            await asyncio.gather(
                *(self._stop_pod(conns[p["ordinal"]], p, timeout) for p in state["pods"])
            )
            for c in conns:
                c.close()
            self._live.pop(name, None)

        try:
            self._loop.run(stop(), timeout + 60)
        finally:
            self._forget(name)
        return True

    def list(self) -> list[dict[str, Any]]:
        rows = []
        root = _home()
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            state = self._current(d.name)
            if state is not None:
                ready = sum(sh.tcp_ok_now(p["address"], p["port"]) for p in state["pods"])
                rows.append(
                    {
                        "name": d.name,
                        "backend": self.name,
                        "pods": len(state["pods"]),
                        "ready": ready,
                        "hosts": state.get("hosts"),
                        "detached": state.get("detached", False),
                    }
                )
        return rows

    def logs(
        self, name: str, ordinal: int | None = None, follow: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        """Each host's pod log, read over SSH (``tail -F`` when following)."""
        state = self._current(name)
        if state is None:
            raise DeployError(f"no ssh deployment {name!r}")
        pods = [p for p in state["pods"] if ordinal is None or p["ordinal"] == ordinal]
        if not pods:
            raise DeployError(f"deployment {name!r} has no pod {ordinal}")
        hosts = _hosts_from_state(state)
        lines: queue.Queue[str | None] = queue.Queue()
        flag = "-F" if follow else ""
        count = f"-n {int(tail)}" if tail else "-n +1"

        async def read() -> None:
            conns = await self._connect(name, hosts)

            async def one(pod: dict[str, Any]) -> None:
                log = sh.remote_path(f"{pod['run_dir']}/pod.log")
                command = f"tail {count} {flag} {log} 2>/dev/null; true"
                async with conns[pod["ordinal"]].conn.create_process(
                    command, encoding="utf-8", errors="replace"
                ) as proc:
                    async for line in proc.stdout:
                        lines.put(f"[{pod['name']}] {line.rstrip()}")

            try:
                await asyncio.gather(*(one(p) for p in pods))
            finally:
                lines.put(None)

        task = asyncio.run_coroutine_threadsafe(read(), self._loop.loop)
        try:
            while True:
                try:  # following waits as long as the logs go on; a plain read has a limit
                    line = lines.get(timeout=None if follow else COMMAND_TIMEOUT_S)
                except queue.Empty:
                    raise DeployError(
                        f"reading the logs of {name!r} over SSH took over "
                        f"{COMMAND_TIMEOUT_S:.0f}s; a host may be unreachable"
                    ) from None
                if line is None:
                    break
                yield line
            task.result(60)
        finally:
            task.cancel()


def _env_of(resolved: list[kt_secrets.Resolved]) -> dict[str, str]:
    return {k: v for r in resolved for k, v in r.env.items()}


def _options(hosts: Hosts) -> dict[str, Any]:
    return {
        "accept_new_host_keys": hosts.accept_new_host_keys,
        "python": hosts.python,
        "forward": hosts.forward,
        "master_addr": hosts.master_addr,
        "ssh_config": hosts.ssh_config,
        "known_hosts": hosts.known_hosts,
    }


def _hosts_from_state(state: dict[str, Any]) -> Hosts:
    return Hosts(tuple(Host(a) for a in state["hosts"]), **state.get("options", {}))
