"""Launches: what ``POST /deploy`` installs on this pod's ranks, and the launch an
autoscaled replica boots from.

A launch is installed once per launch id: a caller that lost the answer (a proxy dropped it)
sends the same launch again and gets the same answer.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gzip
import logging
import os
from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import Response

from ktlite_server import launchtree
from ktlite_server.bodies import read_body
from ktlite_server.deployment import Colocated, Deployment
from ktlite_server.pod import Pod
from ktlite_server.refusal import refuse
from ktlite_wire import calltree
from ktlite_wire.distenv import distributed_env
from ktlite_wire.errors import ErrorCode, ProtocolError
from ktlite_wire.headers import TREE_HEADER
from ktlite_wire.launch import Colocation, Launch, decode_deploy
from ktlite_wire.outcome import CallResult, RankOutcome
from ktlite_wire.status import Status

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
        # the newest generation of the served deployment's launches this pod took, and whose
        # (0: none; a plain deployment's launches are not ordered)
        self.generation = 0
        self.generation_of = ""

    async def deploy(self, request: Request) -> Response:
        """``POST /deploy``: install a launch (with the ``x-ktlite-tree`` header: here and,
        relayed, on this pod's subtree: ``launchtree.py``), or add/replace/drop a colocated
        target."""
        body, path = await read_body(request, self.max_body)
        try:
            msg = decode_deploy(body)  # JSON and opaque buffers: nothing is unpickled here
            header = request.headers.get(TREE_HEADER)
            tree = None if header is None else calltree.LaunchRelay.decode(header)
        except (ProtocolError, ValueError) as e:
            raise refuse(400, ErrorCode.BAD_REQUEST, f"malformed deploy request: {e}") from e
        finally:
            if path:
                os.unlink(path)  # a large body stays mapped while it is relayed
        if tree is not None and tree.subtree[0] != self.pod.ordinal:
            raise refuse(
                400,
                ErrorCode.BAD_REQUEST,
                f"a relayed launch for pod {tree.subtree[0]} reached pod {self.pod.name} "
                f"(ordinal {self.pod.ordinal})",
            )
        if isinstance(msg, Colocation):
            return await self._colocate(msg, tree, body)
        if tree is None:
            return self._outcomes(await self.install(msg))
        below = launchtree.relay(self.pod.peers, tree, msg.distributed, body)
        refused = launchtree.python_mismatch(tree, msg.distributed, self.pod.ordinal)
        if refused is not None:
            return self._outcomes([], await below, refused)
        own = self.install(dataclasses.replace(msg, ordinal=self.pod.ordinal))
        outs, relayed = await asyncio.gather(own, below)
        return self._outcomes(outs, relayed)

    def _outcomes(
        self, outs: list[Any], relayed: CallResult | None = None, made: Sequence[RankOutcome] = ()
    ) -> Response:
        """This pod's outcomes (``outs``, from its ranks; ``made``, made up here), and what its
        children answered, their results nested untouched (only the caller decodes them)."""
        name = self.pod.name
        result = CallResult(
            [RankOutcome(o.rank, name, o.status, o.data, o.message, o.at) for o in outs]
            + list(made)
            + (relayed.outcomes if relayed is not None else []),
            subtrees=relayed.subtrees if relayed is not None else [],
        )
        return Response(result.encode_bytes(), media_type="application/octet-stream")

    async def install(self, msg: Launch) -> list[Any]:
        """Install a launch (a POST /deploy body, or the launch file a replica boots from)."""
        outs: list[Any] = await asyncio.shield(self.begin(msg))
        return outs

    def begin(self, msg: Launch) -> asyncio.Task[list[Any]]:
        """Start installing ``msg`` (or find its install running or done). No await before the
        install is recorded: which launch is this pod's newest is decided in one step."""
        pod = self.pod
        self._check_order(msg)
        if msg.replica:
            # an autoscaled deployment's replica is a world of its own: rank 0 of one pod, at
            # this pod's own address (a replica started later reads the launch the client wrote)
            ip = os.environ.get("KTLITE_POD_IP") or (msg.pod_ips or ["127.0.0.1"])[0]
            msg = dataclasses.replace(msg, ordinal=pod.ordinal, pod_ips=[ip])
        try:
            dep = Deployment(
                launch_id=msg.launch_id,
                bundle=msg.bundle,
                kind=msg.kind,
                init=msg.init,
                sources=msg.sources,
                config=msg.distributed,
                pod_ips=msg.pod_ips,
                ordinal=msg.ordinal,
                master_port=msg.master_port,
                max_restarts=msg.max_restarts,
                cpus=msg.cpus,
                load_timeout=msg.load_timeout,
                concurrency=msg.concurrency,
                engine=msg.engine,
                single=msg.single,
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
        except Exception as e:  # noqa: BLE001 - an inconsistent layout is the client's fault
            raise refuse(
                400, ErrorCode.BAD_REQUEST, f"malformed deploy request: {type(e).__name__}: {e}"
            ) from e
        if dep.ordinal != pod.ordinal:
            raise refuse(
                400,
                ErrorCode.BAD_REQUEST,
                f"deploy for ordinal {dep.ordinal} sent to pod {pod.name} (ordinal {pod.ordinal})",
            )
        if msg.store is not None:  # the data store's address, for kt.put/get in the ranks
            from ktlite_server.store import remember

            remember(msg.store, pod.pod_ips_file)
        # the order is decided here, with no await since the check: of two launches sent at
        # once, the one with the higher generation is installed, whichever arrives first
        self.generation, self.generation_of = msg.generation, msg.launch_id
        deploys = self.installing
        task = deploys.get(dep.launch_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(pod.deploy(dep, restart=msg.restart))
            deploys[dep.launch_id] = task
            while len(deploys) > KEEP_INSTALLS:
                deploys.popitem(last=False)
        return task

    def _check_order(self, msg: Launch) -> None:
        """Refuse a launch older than the one this pod holds (a lower generation), or another
        launch of the same generation: a handle of an older ``.to()`` of the service must not
        replace the code of a newer one, whatever the order its push arrives in."""
        held, of = self.generation, self.generation_of
        if msg.generation > held:
            return
        if msg.generation == held and (held == 0 or msg.launch_id == of):
            return  # the same launch again, or not ordered (a plain deployment's: the newest wins)
        why = (
            f"launch {msg.launch_id} has generation {msg.generation}, older than that"
            if msg.generation < held
            else f"launch {msg.launch_id} claims the same generation {held}"
        )
        raise refuse(
            409,
            ErrorCode.STALE_LAUNCH,
            f"pod {self.pod.name} holds launch {of} of generation {held}; {why}: a newer "
            ".to() of this service deployed its code since, so this launch was not installed. "
            "Use the handle the newest .to() returned, or call .to() again",
        )

    def start_boot(self, path: str) -> None:
        """A replica started by an autoscaler loads the launch the client left for it (a
        mounted Secret on Kubernetes, a file locally) before it reports ready. Called before
        the server takes requests: the launch file's generation is held first, so a push of an
        older launch is refused and a push of a newer one (the file was stale) replaces it."""
        try:
            with open(path, "rb") as f:
                data = f.read()
            if data[:2] == b"\x1f\x8b":  # gzip: a launch kept in a Kubernetes Secret
                data = gzip.decompress(data)
            msg = decode_deploy(data)
            if not isinstance(msg, Launch):
                raise ProtocolError("it holds a colocation, not a launch")
        except FileNotFoundError:
            self.boot = "no launch yet: waiting for the client's POST /deploy"
            return
        except Exception as e:  # noqa: BLE001 - shown by /health?ready=1 and the log
            self.boot = f"the launch file {path} could not be read: {type(e).__name__}: {e}"
            logger.error("%s", self.boot)
            return
        try:
            task = self.begin(msg)
        except HTTPException as e:
            self.boot = f"the launch file {path} was refused: {e.detail}"
            logger.error("%s", self.boot)
            return
        self.boot_task = asyncio.get_running_loop().create_task(self._booted(msg, task))

    async def _booted(self, msg: Launch, task: asyncio.Task[list[Any]]) -> None:
        outs: list[Any] = await asyncio.shield(task)
        failed = [o for o in outs if o.status is not Status.OK]
        self.boot = (
            f"loading launch {msg.launch_id} failed on rank(s) "
            f"{', '.join(str(o.rank) for o in failed)}: {failed[0].message}"
            if failed
            else None
        )
        if failed:
            logger.error("%s", self.boot)

    async def _colocate(
        self, msg: Colocation, tree: calltree.LaunchRelay | None, body: Any
    ) -> Response:
        """A colocation launch (``kt.cls(B).to(remote_a)``): add, replace or (``drop``) remove
        a named target in the rank processes of the deployment this pod serves; with ``tree``
        (the ``x-ktlite-tree`` header) here and, relayed as a code push is, on its subtree."""
        pod, name = self.pod, msg.target
        target = (
            None
            if msg.drop or msg.bundle is None
            else Colocated(bundle=msg.bundle, kind=msg.kind, init=msg.init, sources=msg.sources)
        )
        if pod.dep is None:
            raise refuse(
                409,
                ErrorCode.NOT_DEPLOYED,
                f"pod {pod.name} has no code deployed to colocate "
                f"{name!r} with; deploy the first group again",
            )
        if msg.launch_id and msg.launch_id != pod.dep.launch_id and target is not None:
            raise refuse(
                409,
                ErrorCode.REDEPLOYED,
                f"pod {pod.name} runs launch {pod.dep.launch_id}, not "
                f"{msg.launch_id}: the deployment to colocate {name!r} "
                "with was redeployed since",
            )
        own = pod.colocate(name, target, if_missing=msg.if_missing)
        if tree is None:
            return self._outcomes(await own)
        below = launchtree.relay(pod.peers, tree, pod.dep.config, body)
        outs, relayed = await asyncio.gather(own, below)
        return self._outcomes(outs, relayed)
