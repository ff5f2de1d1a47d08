"""A pod's Ray node (``distribute("ray")``): ``ray start`` run by the pod server, by IP.

Pod 0 starts the head; every other pod waits until the head's GCS port answers and joins
it. The node is one ``ray start --block`` process tree, an engine of the pod
(``ktlite_server.engine``): stopping it is ``ray stop`` for this node only (SIGTERM, Ray's own
shutdown of its processes, then SIGKILL to what is left of its session), then the node's
temp dir is removed.

The node's settings come from the client (``ktlite.modes.engines.ray_node``): ports from the
deployment's range, the pod's CPUs, GPUs and memory. A deploy with the same settings keeps
the running node (a code-only redeploy does not restart Ray). Ray's own startup waits are
the deployment's ``launch_timeout`` (:func:`startup_env`), and a node whose raylet or GCS
dies while ``ray start`` waits fails at once with the line Ray logged (:func:`fatal_line`).
The head knows the cluster's members through ``ktlite_server.ray_members``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import math
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

from ktlite_server.engine import STOP_GRACE_S, Engine, EngineError, env_without_token, wait_port
from ktlite_server.peers import PeerPool
from ktlite_server.ray_members import (
    Members,
    auth_env,
    engine_failed,
    failed_members,
    missing_nodes,
    nodes,
)

STARTED = "Ray runtime started."
WATCH_S = 0.5  # how often a starting node's logs, and the head's peers, are looked at
# a line of Ray's C++ log at severity C (fatal: a failed check, such as a port already in use)
FATAL = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+ C \d+ \d+\]")

__all__ = [
    "EngineError",
    "RayNode",
    "auth_env",
    "fatal_line",
    "missing_nodes",
    "nodes",
    "start_args",
    "startup_env",
]


def pod_ray_version() -> str | None:
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None


def start_args(cfg: dict[str, Any], temp_dir: str) -> list[str]:
    """``ray start`` arguments for one node (pure: tested without Ray)."""
    ports = cfg["ports"]
    args = [
        "start",
        "--block",
        "--disable-usage-stats",
        f"--node-ip-address={cfg['node_ip']}",
        f"--temp-dir={temp_dir}",
        f"--node-manager-port={ports['node_manager']}",
        f"--object-manager-port={ports['object_manager']}",
        f"--runtime-env-agent-port={ports['runtime_env_agent']}",
        f"--dashboard-agent-grpc-port={ports['dashboard_agent_grpc']}",
        f"--dashboard-agent-listen-port={ports['dashboard_agent_listen']}",
        f"--metrics-export-port={ports['metrics_export']}",
        f"--min-worker-port={ports['min_worker']}",
        f"--max-worker-port={ports['max_worker']}",
    ]
    if cfg["head"]:
        args += [
            "--head",
            f"--port={ports['gcs']}",
            f"--ray-client-server-port={ports['client_server']}",
            f"--dashboard-port={ports['dashboard']}",
            f"--include-dashboard={'true' if cfg.get('dashboard') else 'false'}",
        ]
    else:
        args.append(f"--address={cfg['address']}")
    for key, flag in (
        ("num_cpus", "--num-cpus"),
        ("num_gpus", "--num-gpus"),
        ("memory", "--memory"),
        ("object_store_memory", "--object-store-memory"),
    ):
        if cfg.get(key) is not None:
            args.append(f"{flag}={int(cfg[key])}")
    return args


def startup_env(timeout: float) -> dict[str, str]:
    """Ray's own waits while a node starts, as long as ktlite's (the deployment's
    ``launch_timeout``): on a busy machine a node's registration with the GCS, its connection
    to the GCS and its agents take longer than Ray's defaults (10-30 s), and Ray then gives
    up ("The current node timed out during startup") while ktlite would still wait."""
    seconds = max(1, math.ceil(timeout))
    return {
        "RAY_raylet_start_wait_time_s": str(seconds),  # the node's registration with the GCS
        "RAY_gcs_server_port_wait_time_s": str(seconds),  # connecting to the GCS (~1 s a try)
        "RAY_agent_register_timeout_ms": str(seconds * 1000),  # the raylet's agents
    }


def fatal_line(temp_dir: str) -> str | None:
    """The first fatal line the raylet or GCS of the node under ``temp_dir`` logged, with the
    log's name. ``ray start`` does not notice its raylet dying (a port already in use): it
    waits for the node to register, as long as it is let."""
    logs = os.path.join(temp_dir, "session_latest", "logs")
    for name in ("raylet.out", "gcs_server.out"):
        with contextlib.suppress(OSError), open(os.path.join(logs, name), errors="replace") as f:
            for line in f:
                if FATAL.match(line):
                    return f"{name}: {line.strip()[:1500]}"
    return None


def _child_named(parent: int, name: str) -> int | None:
    """The pid of ``parent``'s child process called ``name`` (Linux ``/proc``), if any."""
    with contextlib.suppress(OSError), os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{entry.name}/stat") as f:
                    # "pid (comm) state ppid ...": comm may hold spaces, so split after ')'
                    head, _, rest = f.read().rpartition(")")
                    if head.partition("(")[2] == name and int(rest.split()[1]) == parent:
                        return int(entry.name)
    return None


class RayNode(Engine):
    kind = "ray"

    def __init__(
        self,
        cfg: dict[str, Any],
        pod: str,
        log: Any,
        launch_id: str = "",
        peers: PeerPool | None = None,
    ) -> None:
        super().__init__(cfg, pod, log, launch_id, peers)
        self.temp_dir = ""
        self.members = Members(cfg) if cfg.get("head") else None

    async def start(self, timeout: float) -> None:
        """Start the node and wait until Ray says it runs (the node is then registered with
        the head's GCS: ``ray start`` checks that itself)."""
        theirs, ours = pod_ray_version(), self.cfg.get("version")
        image = os.environ.get("KTLITE_IMAGE") or "this pod's image"
        if theirs is None:
            raise EngineError(
                f"pod {self.pod}: Ray is not installed in {image} ({sys.executable}); "
                f"add it to the image: kt.Image(...).pip_install('ray[default]=={ours or 'X'}'), "
                "or use kt.images.ray(...)"
            )
        if ours and theirs != ours:
            raise EngineError(
                f"pod {self.pod} has Ray {theirs}, this client Ray {ours}: Ray needs the same "
                f"version on the driver's side and the cluster's; install ray=={theirs} here "
                f"or pip_install('ray[default]=={ours}') in the image"
            )
        deadline = time.monotonic() + timeout
        if not self.cfg["head"]:
            host, _, port = self.cfg["address"].rpartition(":")
            await wait_port(
                host,
                int(port),
                deadline,
                f"pod {self.pod}: the Ray head's GCS at {self.cfg['address']} (pod 0)",
                "pod 0's log (remote.logs()) has its ray start output",
                self._head_failed,
            )
        # short: Ray's unix sockets live under it and their paths must fit 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="ktray-")
        env = env_without_token()
        for key, value in startup_env(timeout).items():
            env.setdefault(key, value)  # the user's own setting (Compute(env=...)) wins
        # no drain on SIGTERM (30 s by default, for Ray Serve): ktlite stops a node only when
        # its deployment goes
        env.update(
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONUNBUFFERED="1",
            RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
            **auth_env(self.cfg),
        )
        cmd = [
            sys.executable,
            "-c",
            "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()",
            *start_args(self.cfg, self.temp_dir),
        ]
        self.log(
            "starting Ray "
            + ("head" if self.cfg["head"] else "worker node")
            + f" on {self.cfg['node_ip']}"
        )
        started = self._expect(STARTED)
        await self._spawn(cmd, env)
        fatal = asyncio.ensure_future(self._fatal())
        if not await self._until(started.wait(), deadline - time.monotonic(), fatal):
            assert self.proc is not None
            died = (
                fatal.result()
                if fatal.done() and not fatal.cancelled()
                else fatal_line(self.temp_dir)
            )
            why = (
                f"exited with code {self.proc.returncode}"
                if not self.alive
                else "failed: its raylet or GCS died"
                if died
                else f"did not report '{STARTED}' within {timeout:.0f}s"
            )
            await self.stop()
            detail = f" (Ray logged {died})" if died else ""
            raise EngineError(
                f"pod {self.pod}: ray start {why}{detail}; its output:\n{self.tail()}"
            )
        self.started_at = time.time()

    async def _fatal(self) -> str:
        """Once the node's raylet or GCS logs a fatal line, or its raylet (a child of ``ray
        start`` until the node runs) exits without one (killed, out of memory): what
        happened."""
        raylet: int | None = None
        while (line := fatal_line(self.temp_dir)) is None:
            if raylet is None:
                raylet = _child_named(self.proc.pid, "raylet") if self.proc else None
            elif not os.path.exists(f"/proc/{raylet}"):
                await asyncio.sleep(WATCH_S)  # its last words reach the log first
                return fatal_line(self.temp_dir) or f"nothing: its raylet (pid {raylet}) exited"
            await asyncio.sleep(WATCH_S)
        return line

    @classmethod
    def rank_env(cls, cfg: dict[str, Any]) -> dict[str, str]:
        # ray.init() and ray.init("auto") connect to this cluster, with its token
        return {"RAY_ADDRESS": cfg["address"], **auth_env(cfg)}

    async def await_cluster(self, timeout: float) -> None:
        """On the head: until the GCS lists every pod's node alive. A pod whose node failed
        (its server says so) ends the wait at once, with that pod's own error."""
        if not self.cfg["head"]:
            return
        cfg = self.cfg
        expected = cfg["expected"]  # every pod's node: {"pod", "ip", "port"[, "health"]}
        probe = asyncio.ensure_future(nodes(cfg, len(expected), timeout))
        try:
            while not (await asyncio.wait([probe], timeout=WATCH_S))[0]:
                failed = await failed_members(self.peers, expected, self.launch_id)
                if failed:
                    # each pod's first line (its whole error is its own outcome)
                    lines = "\n".join(f"- {why.splitlines()[0]}" for _, why in failed)
                    raise EngineError(
                        f"the Ray cluster at {cfg['address']} cannot form: "
                        f"{len(failed)} of {len(expected)} node(s) failed to start:\n{lines}"
                    )
        finally:
            if not probe.done():
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError, EngineError):
                    await probe
        found = probe.result()
        missing = missing_nodes(expected, found)
        if missing:
            names = ", ".join(
                f"{e['pod']} ({e['ip']}, node manager port {e['port']})" for e in missing
            )
            joined = ", ".join(f"{n['ip']}:{n['port']}" for n in found if n["alive"]) or "none"
            raise EngineError(
                f"{len(expected) - len(missing)} of {len(expected)} Ray nodes joined the head "
                f"at {cfg['address']} within {timeout:.0f}s; missing: {names} (alive in "
                f"the cluster: {joined}). Their pods' own errors follow, or their logs "
                "(remote.logs()) hold ray start's output"
            )
        assert self.members is not None
        self.members.seed(found)

    async def cluster_status(self) -> dict[str, Any]:
        """This node, and on the head the cluster's nodes with the lost ones named, as of
        ``nodes_as_of`` (the last list the GCS gave: asking it can take seconds)."""
        out = self.status()
        if self.members is not None and self.alive:
            out.update(await self.members.snapshot())
        return out

    async def _head_failed(self) -> str | None:
        """Why the head pod could not start Ray for this launch, as its /health says, if so."""
        url = self.cfg.get("head_health")
        if not url:
            return None
        return await engine_failed(self.peers, url, self.launch_id)

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        if self.members is not None:
            await self.members.close()  # a status probe under way
        await super().stop(grace)

    def _cleanup(self) -> None:
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        return {
            **super().status(),
            "address": self.cfg["address"],
            "node_ip": self.cfg["node_ip"],
            "temp_dir": self.temp_dir,
        }
