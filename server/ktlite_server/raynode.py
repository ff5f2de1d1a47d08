"""A pod's Ray node (``distribute("ray")``): ``ray start`` run by the pod server, by IP.

Pod 0 starts the head; every other pod waits until the head's GCS port answers and joins
it. The node is one ``ray start --block`` process tree, an engine of the pod
(``ktlite_server.engine``): stopping it is ``ray stop`` for this node only (SIGTERM, Ray's own
shutdown of its processes, then SIGKILL to what is left of its session), then the node's
temp dir is removed.

The node's settings come from the client (``ktlite.engines.ray_node``): ports from the
deployment's range, the pod's CPUs, GPUs and memory. A deploy with the same settings keeps
the running node (a code-only redeploy does not restart Ray).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from ktlite_server.engine import Engine, EngineError, env_without_token, wait_port

STARTED = "Ray runtime started."
PROBE_TIMEOUT_S = 15.0

__all__ = ["EngineError", "RayNode", "auth_env", "missing_nodes", "nodes", "start_args"]


def auth_env(cfg: dict[str, Any]) -> dict[str, str]:
    """Environment of every process that talks to the node's cluster: Ray's token mode with
    the deployment's Ray token, or explicitly none (a ~/.ray/auth_token left by some other
    ray.init() on this machine must not switch one node on and leave another off)."""
    token = cfg.get("auth_token")
    return (
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        if token
        else {"RAY_AUTH_MODE": "disabled"}
    )


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


class RayNode(Engine):
    kind = "ray"

    def __init__(self, cfg: dict[str, Any], pod: str, log: Any, launch_id: str = "") -> None:
        super().__init__(cfg, pod, log, launch_id)
        self.temp_dir = ""

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
        if not await self._until(started.wait(), deadline - time.monotonic()):
            assert self.proc is not None
            why = (
                f"exited with code {self.proc.returncode}"
                if not self.alive
                else f"did not report '{STARTED}' within {timeout:.0f}s"
            )
            await self.stop()
            raise EngineError(f"pod {self.pod}: ray start {why}; its output:\n{self.tail()}")
        self.started_at = time.time()

    @classmethod
    def rank_env(cls, cfg: dict[str, Any]) -> dict[str, str]:
        # ray.init() and ray.init("auto") connect to this cluster, with its token
        return {"RAY_ADDRESS": cfg["address"], **auth_env(cfg)}

    async def await_cluster(self, timeout: float) -> None:
        """On the head: until the GCS lists every pod's node alive."""
        if not self.cfg["head"]:
            return
        cfg = self.cfg
        expected = cfg["expected"]  # every pod's node: {"pod", "ip", "port"}
        found = await nodes(cfg, len(expected), timeout)
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

    async def cluster_status(self) -> dict[str, Any]:
        """This node, and on the head the cluster's nodes with the lost ones named."""
        out = self.status()
        if self.cfg["head"] and self.alive:
            try:
                found = await nodes(self.cfg, 0, 0)
            except EngineError as e:
                out["error"] = str(e)
            else:
                out["nodes"] = found
                out["lost"] = [e["pod"] for e in missing_nodes(self.cfg["expected"], found)]
        return out

    async def _head_failed(self) -> str | None:
        """Why the head pod could not start Ray for this launch, as its /health says, if so."""
        url = self.cfg.get("head_health")
        if not url:
            return None
        import httpx

        try:
            async with httpx.AsyncClient(timeout=1.0) as client:
                failed = (await client.get(url)).json().get("engine_failed")
        except (httpx.HTTPError, ValueError):
            return None
        if failed and failed.get("launch_id") == self.launch_id:
            return str(failed.get("message"))
        return None

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


def missing_nodes(
    expected: list[dict[str, Any]], found: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The expected Ray nodes (``{"pod", "ip", "port"}``) the GCS does not list alive. Nodes
    of one host (the local backend; a head alone there too) are told apart by port alone: Ray
    reports a node given 127.0.0.1 by the host's own address, and every pod's node has ports
    of its own."""
    one_host = len({e["ip"] for e in expected}) == 1
    alive = {n["port"] if one_host else (n["ip"], n["port"]) for n in found if n["alive"]}
    return [e for e in expected if (e["port"] if one_host else (e["ip"], e["port"])) not in alive]


async def nodes(cfg: dict[str, Any], want: int, timeout: float) -> list[dict[str, Any]]:
    """The nodes of ``cfg``'s cluster as its GCS lists them, once ``want`` are alive or
    ``timeout`` ran out (``want`` 0: at once). Asked in a subprocess: the pod server never
    imports Ray."""
    address = cfg["address"]
    env = env_without_token()
    env.update(auth_env(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ktlite_server.ray_probe",
        address,
        str(want),
        str(timeout),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout + PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise EngineError(
            f"asking the Ray GCS at {address} for its nodes took over "
            f"{timeout + PROBE_TIMEOUT_S:.0f}s"
        ) from None
    if proc.returncode != 0:
        raise EngineError(
            f"asking the Ray GCS at {address} for its nodes failed: "
            f"{err.decode(errors='replace').strip()[-2000:]}"
        )
    return list(json.loads(out)["nodes"])
