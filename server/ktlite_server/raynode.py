"""A pod's Ray node (``distribute("ray")``): ``ray start`` run by the pod server, by IP.

Pod 0 starts the head; every other pod waits until the head's GCS port answers and joins
it. The node is one ``ray start --block`` process in a process group of its own that dies
with the pod server (``PR_SET_PDEATHSIG``); stopping it is ``ray stop`` for this node only:
SIGTERM (Ray's own shutdown of its processes), SIGKILL to the group after a grace period,
then the node's temp dir is removed. The global ``ray stop`` is never run: on the local
backend it would kill every Ray on the machine, the user's own included.

The node's settings come from the client (``ktlite.engines.ray_node``): ports from the
deployment's range, the pod's CPUs, GPUs and memory. A deploy with the same settings keeps
the running node (a code-only redeploy does not restart Ray).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import importlib.metadata
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

STARTED = "Ray runtime started."
STOP_GRACE_S = 5.0
PROBE_TIMEOUT_S = 15.0

Log = Callable[[str], None]


class EngineError(Exception):
    """Ray could not be started on this pod; the message says why and what to do."""


def auth_env(cfg: dict[str, Any]) -> dict[str, str]:
    """Environment of every process that talks to the node's cluster: Ray's token mode with
    the deployment's Ray token, or explicitly none (a ~/.ray/auth_token left by some other
    ray.init() on this machine must not switch one node on and leave another off)."""
    token = cfg.get("auth_token")
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {"RAY_AUTH_MODE": "disabled"}


def pod_ray_version() -> str | None:
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None


def start_args(cfg: dict[str, Any], temp_dir: str) -> list[str]:
    """``ray start`` arguments for one node (pure: tested without Ray)."""
    ports = cfg["ports"]
    args = ["start", "--block", "--disable-usage-stats", f"--node-ip-address={cfg['node_ip']}",
            f"--temp-dir={temp_dir}",
            f"--node-manager-port={ports['node_manager']}",
            f"--object-manager-port={ports['object_manager']}",
            f"--runtime-env-agent-port={ports['runtime_env_agent']}",
            f"--dashboard-agent-grpc-port={ports['dashboard_agent_grpc']}",
            f"--dashboard-agent-listen-port={ports['dashboard_agent_listen']}",
            f"--metrics-export-port={ports['metrics_export']}",
            f"--min-worker-port={ports['min_worker']}", f"--max-worker-port={ports['max_worker']}"]
    if cfg["head"]:
        args += ["--head", f"--port={ports['gcs']}", f"--ray-client-server-port={ports['client_server']}",
                 f"--dashboard-port={ports['dashboard']}",
                 f"--include-dashboard={'true' if cfg.get('dashboard') else 'false'}"]
    else:
        args.append(f"--address={cfg['address']}")
    for key, flag in (("num_cpus", "--num-cpus"), ("num_gpus", "--num-gpus"), ("memory", "--memory"),
                      ("object_store_memory", "--object-store-memory")):
        if cfg.get(key) is not None:
            args.append(f"{flag}={int(cfg[key])}")
    return args


def _die_with_parent() -> None:
    """In the child before exec: own process group, SIGTERM when the pod server dies (Ray's
    own shutdown of the node's processes, drain off)."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class RayNode:
    def __init__(self, cfg: dict[str, Any], pod: str, log: Log, launch_id: str = "") -> None:
        self.cfg = cfg
        self.launch_id = launch_id
        self.pod = pod
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=60)
        self.started_at: float | None = None
        self.temp_dir = ""
        self._reader: asyncio.Task[None] | None = None
        self._started = asyncio.Event()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def tail(self, lines: int = 25) -> str:
        return "\n".join(list(self.output)[-lines:]) or "(no output)"

    async def start(self, timeout: float) -> None:
        """Start the node and wait until Ray says it runs (the node is then registered with
        the head's GCS: ``ray start`` checks that itself)."""
        theirs, ours = pod_ray_version(), self.cfg.get("version")
        image = os.environ.get("KTLITE_IMAGE") or "this pod's image"
        if theirs is None:
            raise EngineError(f"pod {self.pod}: Ray is not installed in {image} ({sys.executable}); "
                              f"add it to the image: kt.Image(...).pip_install('ray[default]=={ours or 'X'}'), "
                              "or use kt.images.ray(...)")
        if ours and theirs != ours:
            raise EngineError(f"pod {self.pod} has Ray {theirs}, this client Ray {ours}: Ray needs the same "
                              f"version on the driver's side and the cluster's; install ray=={theirs} here "
                              f"or pip_install('ray[default]=={ours}') in the image")
        deadline = time.monotonic() + timeout
        if not self.cfg["head"]:
            host, _, port = self.cfg["address"].rpartition(":")
            await _wait_port(host, int(port), deadline, f"pod {self.pod}: the Ray head's GCS at "
                             f"{self.cfg['address']} (pod 0)", self._head_failed)
        # short: Ray's unix sockets live under it and their paths must fit 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="ktray-")
        env = {k: v for k, v in os.environ.items() if k != "KTLITE_TOKEN"}
        # no drain on SIGTERM (30 s by default, for Ray Serve): ktlite stops a node only when
        # its deployment goes
        env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
                   **auth_env(self.cfg))
        cmd = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()",
               *start_args(self.cfg, self.temp_dir)]
        self.log("starting Ray " + ("head" if self.cfg["head"] else "worker node") + f" on {self.cfg['node_ip']}")
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        waiter = asyncio.ensure_future(self._started.wait())
        try:
            await asyncio.wait([waiter, self._reader], timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not self._started.is_set():
            why = (f"exited with code {self.proc.returncode}" if not self.alive
                   else f"did not report '{STARTED}' within {timeout:.0f}s")
            await self.stop()
            raise EngineError(f"pod {self.pod}: ray start {why}; its output:\n{self.tail()}")
        self.started_at = time.time()

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

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                break
            text = line.decode(errors="replace").rstrip()
            self.output.append(text)
            self.log(text)
            if STARTED in text:
                self._started.set()
        await self.proc.wait()

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """This node's ``ray stop``: SIGTERM, then SIGKILL to its process group."""
        proc = self.proc
        if proc is not None:
            pgid = proc.pid  # setsid: the group is the process's own id
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), grace)
            # whatever of the node outlived ray start (or it did not end in time)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 5)
            if self._reader is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(self._reader, 2)
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.proc = None

    def status(self) -> dict[str, Any]:
        return {"kind": "ray", "head": self.cfg["head"], "address": self.cfg["address"],
                "node_ip": self.cfg["node_ip"], "pid": self.proc.pid if self.proc else None,
                "alive": self.alive, "started_at": self.started_at, "temp_dir": self.temp_dir}


async def _wait_port(host: str, port: int, deadline: float, what: str,
                     gave_up: Callable[[], Any] | None = None) -> None:
    """Until ``host:port`` accepts a connection; ``gave_up()`` (every 0.5 s) says why it
    never will (the head failed), or None."""
    last = ""
    asked = 0.0
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
            writer.close()
            return
        except (OSError, asyncio.TimeoutError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise EngineError(f"{what} did not accept connections in time (last: {last}); pod 0's "
                              "log (remote.logs()) has its ray start output")
        if gave_up is not None and time.monotonic() - asked >= 0.5:
            asked = time.monotonic()
            why = await gave_up()
            if why:
                raise EngineError(f"{what} will not answer: the head could not start Ray ({why.splitlines()[0]})")
        await asyncio.sleep(0.05)


async def nodes(cfg: dict[str, Any], want: int, timeout: float) -> list[dict[str, Any]]:
    """The nodes of ``cfg``'s cluster as its GCS lists them, once ``want`` are alive or
    ``timeout`` ran out (``want`` 0: at once). Asked in a subprocess: the pod server never
    imports Ray."""
    address = cfg["address"]
    env = {k: v for k, v in os.environ.items() if k != "KTLITE_TOKEN"}
    env.update(auth_env(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ktlite_server.ray_probe", address, str(want), str(timeout),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout + PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise EngineError(f"asking the Ray GCS at {address} for its nodes took over "
                          f"{timeout + PROBE_TIMEOUT_S:.0f}s") from None
    if proc.returncode != 0:
        raise EngineError(f"asking the Ray GCS at {address} for its nodes failed: "
                          f"{err.decode(errors='replace').strip()[-2000:]}")
    return list(json.loads(out)["nodes"])
