"""The backend ``bench_scale.py`` puts in place of the local one (``LocalBackend.shared()``):
its pods are the simulated ones of ``_sim_host.py``, a few processes holding many pod
servers each, reached over loopback HTTP as a cluster's pods are (no shared memory: values
and arguments travel in the HTTP bodies, as on Kubernetes and SSH).

What it reports is what a backend reports (an ``Applied``: each pod's name, ordinal, URL and
incarnation), so ``kt.fn(...).to(...)``, the modes and the client run unchanged above it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ktlite.backends.base import Applied, Plan, PodEndpoint
from ktlite.backends.local import LocalBackend
from ktlite.errors import DeployError
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire import calltree

HOST = Path(__file__).with_name("_sim_host.py")
PODS_PER_HOST = 250  # a host process's share of the pods
START_S = 300.0  # how long the hosts may take to report their ports


class _Hosts:
    """The host processes of one deployment, and what they report."""

    def __init__(self, spec: DeploymentSpec, token: str) -> None:
        self.spec, self.token = spec, token
        pods = spec.distributed.workers
        procs = spec.distributed.max_procs
        # pod 0 (the caller's coordinator) and pod 1 (in a tree, a relay; flat, a member) in
        # hosts of their own, when there are others: their CPU per call is then measured
        # apart from the rest's; in a tree, the pods pod 1 relays to in one host of their own
        # too (the longest path's leaves: bench/_scale_path.py)
        runs = [(i, 1) for i in range(min(2, pods - 1))]
        fanout = spec.distributed.tree(pods)
        below_1 = calltree.split(list(range(1, pods)), fanout)[0][1:] if fanout else []
        if below_1:
            runs.append((2, len(below_1)))
        alone = sum(count for _, count in runs)
        rest = pods - alone
        parts = max(1, -(-rest // PODS_PER_HOST))
        share = -(-rest // parts)
        runs += [(alone + k * share, min(share, rest - k * share)) for k in range(parts) if rest]
        self.below_1 = below_1
        hosts = len(runs)
        self.dir = tempfile.mkdtemp(prefix="ktlite-sim-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.owner: dict[int, subprocess.Popen[bytes]] = {}
        self.ports: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        for h, (first, count) in enumerate(runs):
            log = open(os.path.join(self.dir, f"host-{h}.log"), "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, str(HOST), "--name", spec.name, "--first", str(first)]
                + ["--count", str(count), "--procs", str(procs)]
                + ["--ready-file", os.path.join(self.dir, f"host-{h}.json")],
                stdin=subprocess.PIPE,
                # each pod server's own log (every rank line, as a pod's log keeps them)
                stderr=log,
            )
            log.close()  # the child holds its own copy
            assert proc.stdin is not None
            proc.stdin.write(token.encode() + b"\n")
            proc.stdin.flush()
            self.procs.append(proc)
            for i in range(first, first + count):
                self.owner[i] = proc
        self._wait(hosts)

    def _wait(self, hosts: int) -> None:
        deadline = time.monotonic() + START_S
        for h in range(hosts):
            path = os.path.join(self.dir, f"host-{h}.json")
            while not os.path.exists(path):
                if self.procs[h].poll() is not None:
                    raise DeployError(f"simulated host {h} exited with {self.procs[h].returncode}")
                if time.monotonic() > deadline:
                    raise DeployError(f"simulated host {h} did not start within {START_S:g}s")
                time.sleep(0.05)  # polling a file another process writes, bounded above
            info = json.loads(Path(path).read_text())
            for i, port in info["ports"].items():
                self.ports[int(i)] = int(port)
                self.pids[int(i)] = int(info["pid"])

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def applied(self) -> Applied:
        eps = [
            PodEndpoint(
                name=f"{self.spec.name}-{i}",
                ordinal=i,
                url=f"http://127.0.0.1:{port}",
                peer_url=f"http://127.0.0.1:{port}",
                ip="127.0.0.1",
                incarnation=f"{self.pids[i]}:{port}",
            )
            for i, port in sorted(self.ports.items())
        ]
        return Applied(
            name=self.spec.name,
            backend="local",
            endpoints=eps,
            token=self.token,
            master_port=29500,
            same_host=False,
            spec_hash=self.spec.pod_hash(),
        )

    def kill_pod(self, ordinal: int) -> None:
        proc = self.owner[ordinal]
        assert proc.stdin is not None
        proc.stdin.write(f"kill {ordinal}\n".encode())
        proc.stdin.flush()

    def profile(self, ordinal: int, path: str | None) -> None:
        """Start cProfile in the host of pod ``ordinal`` (None), or stop it and write its
        stats to ``path``; :meth:`profiled` waits for them."""
        self.command(ordinal, f"profile {path or 'on'}")

    def command(self, ordinal: int, line: str) -> None:
        """Send the host of pod ``ordinal`` one command (``_sim_host.py``)."""
        proc = self.owner[ordinal]
        assert proc.stdin is not None
        proc.stdin.write(f"{line}\n".encode())
        proc.stdin.flush()

    def profiled(self, path: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the host did not write its profile {path} in {timeout:g}s")
            time.sleep(0.05)  # polling a file another process writes, bounded above

    def stop(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


class SimBackend(LocalBackend):
    """Simulated pods in place of local processes (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.deployments: dict[str, _Hosts] = {}

    def plan(self, spec: DeploymentSpec) -> Plan:
        return Plan(backend=self.name, name=spec.name, commands=[f"{HOST} (simulated pods)"])

    def apply(self, spec: DeploymentSpec, token: str) -> Applied:
        hosts = self.deployments.get(spec.name)
        same = hosts is not None and hosts.spec.distributed.workers == spec.distributed.workers
        if hosts is not None and same and hosts.alive() and hosts.token == token:
            return hosts.applied()
        if hosts is not None:
            hosts.stop()
        hosts = self.deployments[spec.name] = _Hosts(spec, token)
        return hosts.applied()

    def lookup(self, name: str) -> Applied | None:
        hosts = self.deployments.get(name)
        return hosts.applied() if hosts is not None and hosts.alive() else None

    def teardown(self, name: str, timeout: float = 30.0, volumes: bool = False) -> bool:
        hosts = self.deployments.pop(name, None)
        if hosts is not None:
            hosts.stop()
        return hosts is not None

    def list(self) -> list[dict[str, Any]]:
        return [{"name": n, "pods": len(h.ports)} for n, h in self.deployments.items()]


def install() -> SimBackend:
    """Make ``LocalBackend.shared()`` (what ``backend="local"`` resolves to) the simulation."""
    backend = SimBackend()
    LocalBackend._instance = backend  # type: ignore[attr-defined]
    return backend
