"""A pod's Monarch host (``distribute("monarch")``): Monarch's worker loop run by the pod
server, an engine of the pod (``ktlite_server.engine``).

Every pod runs ``monarch.actor.run_worker_loop_forever`` at its address: ``tcp://POD_IP:PORT``
on a cluster (the port pinned from the deployment's range), or a unix socket in a directory
only this user can enter where the pods share a machine (the local backend). The rank
process on pod 0 is Monarch's controller: ``ktlite.distributed.monarch_hosts()`` attaches to
every pod's loop and returns the ``HostMesh``.

Monarch (torchmonarch 0.7) has no authentication on its worker port yet: whoever connects
becomes the host's controller and runs code on it. So the loop listens on the pod IP only,
never a wildcard, and the Kubernetes backend lets only the deployment's own pods reach it
(a NetworkPolicy, enforced where the cluster's network plugin enforces policies).

Each ``.to()`` brings fresh loops (the settings carry the launch): the procs a previous
controller spawned, and the GPU memory they hold, go with the old loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import stat
import sys
import tempfile
import time
from typing import Any

from ktlite_server.engine import Engine, EngineError, env_without_token, session_pids

PROBE_TIMEOUT_S = 1.0
WORKER = (
    "import sys; from monarch.actor import run_worker_loop_forever; "
    "print('ktlite: Monarch worker loop at', sys.argv[1], flush=True); "
    "run_worker_loop_forever(address=sys.argv[1], ca='trust_all_connections')"
)


def pod_monarch_version() -> str | None:
    try:
        return importlib.metadata.version("torchmonarch")
    except importlib.metadata.PackageNotFoundError:
        return None


def socket_dir(cfg: dict[str, Any]) -> str:
    return os.path.join(tempfile.gettempdir(), cfg["ipc_dir"])


def address(cfg: dict[str, Any], ordinal: int) -> str:
    """Pod ``ordinal``'s worker loop address, as Monarch's channels spell it."""
    if cfg["transport"] == "ipc":
        return f"ipc://{socket_dir(cfg)}/{ordinal}"
    host = cfg["hosts"][ordinal]
    return f"tcp://{host['ip']}:{host['port']}"


def private_dir(path: str) -> None:
    """Create ``path`` for this user alone, or accept it only if it already is (a directory
    someone else made, or a link, could hand our sockets to them)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise EngineError(
            f"{path} is not a private directory of this user (mode {stat.filemode(st.st_mode)}, "
            f"owner uid {st.st_uid}); remove it and deploy again"
        )


async def reachable(addr: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a worker loop accepts connections at ``addr`` now."""
    try:
        if addr.startswith("ipc://"):
            conn = asyncio.open_unix_connection(addr[len("ipc://") :])
        else:
            host, _, port = addr[len("tcp://") :].rpartition(":")
            conn = asyncio.open_connection(host, int(port))
        _, writer = await asyncio.wait_for(conn, timeout)
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


class MonarchHost(Engine):
    kind = "monarch"

    @property
    def address(self) -> str:
        return address(self.cfg, self.cfg["ordinal"])

    async def start(self, timeout: float) -> None:
        """Start the worker loop and return once it accepts connections."""
        if pod_monarch_version() is None:
            image = os.environ.get("KTLITE_IMAGE") or "this pod's image"
            raise EngineError(
                f"pod {self.pod}: Monarch is not installed in {image} ({sys.executable}); add it "
                "to the image: kt.Image(...).pip_install('torchmonarch'), or build an image "
                "with it (pip install torchmonarch)"
            )
        deadline = time.monotonic() + timeout
        if self.cfg["transport"] == "ipc":
            private_dir(socket_dir(self.cfg))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address[len("ipc://") :])  # a socket a killed loop left
        env = env_without_token()
        env["PYTHONUNBUFFERED"] = "1"
        self.log(f"starting Monarch worker loop at {self.address}")
        await self._spawn([sys.executable, "-c", WORKER, self.address], env)
        while not await reachable(self.address, 0.5):
            if not self.alive or time.monotonic() >= deadline:
                assert self.proc is not None
                why = (
                    f"exited with code {self.proc.returncode}"
                    if not self.alive
                    else f"did not accept connections at {self.address} within {timeout:.0f}s"
                )
                await self.stop()
                raise EngineError(
                    f"pod {self.pod}: Monarch's worker loop {why}; its output:\n{self.tail()}"
                )
            await asyncio.sleep(0.05)
        self.started_at = time.time()

    @classmethod
    def rank_env(cls, cfg: dict[str, Any]) -> dict[str, str]:
        if not cfg["head"]:
            return {}
        # what ktlite.distributed.monarch_hosts() attaches to (a new launch means new loops),
        # and the controller's own transport: bound to this pod's IP, which the other pods
        # reach (Monarch's default, a unix socket, they would not; its "tcp" resolves the
        # hostname, which a pod without cluster DNS may not map to its IP)
        tcp = cfg["transport"] == "tcp"
        return {
            "KTLITE_MONARCH": json.dumps(
                {
                    "workers": [address(cfg, k) for k in range(len(cfg["hosts"]))],
                    "controller": f"tcp://{cfg['hosts'][0]['ip']}:0" if tcp else "ipc",
                    "per_host": cfg["per_host"],
                    "generation": cfg["generation"],
                }
            )
        }

    async def await_cluster(self, timeout: float) -> None:
        """On pod 0: until every pod's loop accepts connections."""
        if not self.cfg["head"]:
            return
        deadline = time.monotonic() + timeout
        while True:
            seen = await self._probe()
            missing = [f"{h['pod']} ({h['address']})" for h in seen if not h["reachable"]]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"{len(seen) - len(missing)} of {len(seen)} Monarch worker loops accept "
                    f"connections after {timeout:.0f}s; not: {', '.join(missing)}. Their pods' "
                    "own errors follow, or their logs (remote.logs()) say why"
                )
            await asyncio.sleep(0.2)

    async def cluster_status(self) -> dict[str, Any]:
        """This loop and its procs; on pod 0 every pod's loop, the unreachable ones named."""
        out = self.status()
        if self.cfg["head"]:
            out["hosts"] = await self._probe()
            out["lost"] = [h["pod"] for h in out["hosts"] if not h["reachable"]]
        return out

    async def _probe(self) -> list[dict[str, Any]]:
        """Every pod's loop: ``{"pod", "address", "reachable"}``."""
        addrs = [address(self.cfg, k) for k in range(len(self.cfg["hosts"]))]
        up = await asyncio.gather(*(reachable(a) for a in addrs))
        return [
            {"pod": h["pod"], "address": a, "reachable": ok}
            for h, a, ok in zip(self.cfg["hosts"], addrs, up, strict=True)
        ]

    def status(self) -> dict[str, Any]:
        # the procs controllers spawned here: the loop's session, less the loop itself
        procs = len(session_pids(self.proc.pid)) - 1 if self.alive and self.proc is not None else 0
        return {**super().status(), "address": self.address, "procs": max(0, procs)}

    def _cleanup(self) -> None:
        if self.cfg["transport"] == "ipc":
            with contextlib.suppress(OSError):
                os.unlink(self.address[len("ipc://") :])
            with contextlib.suppress(OSError):
                os.rmdir(socket_dir(self.cfg))  # the last pod's loop to go removes it
