"""Launches: what ``POST /deploy`` installs on this pod's ranks, and the launch an
autoscaled replica boots from.

A launch is installed once per launch id: a caller that lost the answer (a proxy dropped it)
sends the same launch again and gets the same answer.
"""

from __future__ import annotations

import asyncio
import collections
import gzip
import logging
import os
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import Response

from ktlite import protocol
from ktlite.spec import DistributedConfig, distributed_env
from ktlite_server.bodies import read_body
from ktlite_server.pod import Colocated, Deployment, Pod

logger = logging.getLogger(__name__)

KEEP_INSTALLS = 8  # launches whose install (and answer) is kept for a caller that asks again


class Launches:
    """This pod's launches: ``POST /deploy`` and a replica's boot launch."""

    def __init__(self, pod: Pod, max_body: int) -> None:
        self.pod = pod
        self.max_body = max_body
        # by launch id, the newest last: each launch is installed once
        self.installing: collections.OrderedDict[str, asyncio.Task[list[Any]]] = (
            collections.OrderedDict()
        )
        self.boot: str | None = (
            None  # why the boot launch is not loaded (``/health?ready=1`` says it)
        )
        self.boot_task: asyncio.Task[None] | None = None

    async def deploy(self, request: Request) -> Response:
        """``POST /deploy``: install a launch, or add/replace/drop a colocated target."""
        pod = self.pod
        body, path = await read_body(request, self.max_body)
        try:
            msg = protocol.loads(body)
            if msg.get("colocate"):
                name = str(msg["colocate"])
                target = (
                    None
                    if msg.get("drop")
                    else Colocated(
                        bundle=bytes(msg["bundle"]),
                        kind=str(msg["kind"]),
                        init=msg.get("init"),
                        sources=dict(msg.get("sources") or {}),
                    )
                )
        except Exception as e:  # noqa: BLE001
            if path:
                os.unlink(path)
            raise HTTPException(400, f"malformed deploy request: {type(e).__name__}: {e}") from e
        if msg.get("colocate"):
            if path:
                os.unlink(path)
            return await self._colocate(msg, name, target)
        try:
            outs = await self.install(msg)
        finally:
            if path:
                os.unlink(path)
        parts = protocol.gather_parts(
            [(o.rank, pod.name, o.status, o.data, o.message, o.at) for o in outs]
        )
        return Response(
            b"".join(bytes(memoryview(p)) for p in parts), media_type="application/octet-stream"
        )

    async def install(self, msg: dict[str, Any]) -> list[Any]:
        """Install a launch (a POST /deploy body, or the launch file a replica boots from)."""
        pod = self.pod
        if msg.get("replica"):
            # an autoscaled deployment's replica is a world of its own: rank 0 of one pod, at
            # this pod's own address (a replica started later reads the launch the client wrote)
            msg = {
                **msg,
                "ordinal": pod.ordinal,
                "pod_ips": [
                    os.environ.get("KTLITE_POD_IP") or msg.get("pod_ips", ["127.0.0.1"])[0]
                ],
            }
        try:
            dep = Deployment(
                launch_id=msg["launch_id"],
                bundle=bytes(msg["bundle"]),
                kind=msg["kind"],
                init=msg.get("init"),
                sources=msg.get("sources") or {},
                config=DistributedConfig(**msg["distributed"]),
                pod_ips=list(msg["pod_ips"]),
                ordinal=int(msg["ordinal"]),
                master_port=int(msg["master_port"]),
                max_restarts=int(msg.get("max_restarts", 3)),
                cpus=msg.get("cpus"),
                load_timeout=float(msg.get("load_timeout", 300)),
                concurrency=max(1, int(msg.get("concurrency", 1))),
                engine=msg.get("engine"),
                single=bool(msg.get("single", False)),
            )
            # the same env every rank would get: a bad layout is refused here, before it
            # replaces the deployment the pod is serving
            distributed_env(
                dep.config,
                node_rank=dep.ordinal,
                local_rank=0,
                pod_ips=dep.pod_ips,
                master_port=dep.master_port,
            )
            if not 0 <= dep.ordinal < dep.config.workers:
                raise ValueError(f"ordinal {dep.ordinal} is outside 0..{dep.config.workers - 1}")
        except Exception as e:  # noqa: BLE001 - any undecodable or inconsistent body is the client's fault
            raise HTTPException(400, f"malformed deploy request: {type(e).__name__}: {e}") from e
        if dep.ordinal != pod.ordinal:
            raise HTTPException(
                400,
                f"deploy for ordinal {dep.ordinal} sent to pod {pod.name} (ordinal {pod.ordinal})",
            )
        if "store" in msg:  # the data store's address, for kt.put/get in the ranks
            from ktlite_server.store import remember

            remember(msg["store"], pod.pod_ips_file)
        # a launch is installed once: a caller that lost the answer (a proxy dropped it) sends
        # the same launch again and gets the same answer
        deploys = self.installing
        task = deploys.get(dep.launch_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                pod.deploy(dep, restart=bool(msg.get("restart")))
            )
            deploys[dep.launch_id] = task
            while len(deploys) > KEEP_INSTALLS:
                deploys.popitem(last=False)
        outs: list[Any] = await asyncio.shield(task)
        return outs

    async def boot_launch(self, path: str) -> None:
        """A replica started by an autoscaler loads the launch the client left for it (a
        mounted Secret on Kubernetes, a file locally) before it reports ready."""
        try:
            with open(path, "rb") as f:
                data = f.read()
            if data[:2] == b"\x1f\x8b":  # gzip: a launch kept in a Kubernetes Secret
                data = gzip.decompress(data)
            msg = protocol.loads(data)
        except FileNotFoundError:
            self.boot = "no launch yet: waiting for the client's POST /deploy"
            return
        except Exception as e:  # noqa: BLE001 - shown by /health?ready=1 and the log
            self.boot = f"the launch file {path} could not be read: {type(e).__name__}: {e}"
            logger.error("%s", self.boot)
            return
        try:
            outs = await self.install(msg)
        except HTTPException as e:
            self.boot = f"the launch file {path} was refused: {e.detail}"
            logger.error("%s", self.boot)
            return
        failed = [o for o in outs if o.status != "ok"]
        self.boot = (
            f"loading launch {msg.get('launch_id')} failed on rank(s) "
            f"{', '.join(str(o.rank) for o in failed)}: {failed[0].message}"
            if failed
            else None
        )
        if failed:
            logger.error("%s", self.boot)

    async def _colocate(self, msg: dict[str, Any], name: str, target: Colocated | None) -> Response:
        """A colocation launch (``kt.cls(B).to(remote_a)``): add, replace or (``drop``) remove
        a named target in the rank processes of the deployment this pod serves."""
        pod = self.pod
        if pod.dep is None:
            raise HTTPException(
                409,
                f"pod {pod.name} has no code deployed to colocate {name!r} with; "
                "deploy the first group again",
            )
        if msg.get("launch_id") and msg["launch_id"] != pod.dep.launch_id and target is not None:
            raise HTTPException(
                409,
                f"pod {pod.name} runs launch {pod.dep.launch_id}, not "
                f"{msg['launch_id']}: the deployment to colocate {name!r} with was "
                "redeployed since",
            )
        outs = await pod.colocate(name, target, if_missing=bool(msg.get("if_missing")))
        parts = protocol.gather_parts(
            [(o.rank, pod.name, o.status, o.data, o.message, o.at) for o in outs]
        )
        return Response(
            b"".join(bytes(memoryview(p)) for p in parts), media_type="application/octet-stream"
        )
