"""Calls: ``POST /call`` runs a call on this pod's ranks (and, on the pod that coordinates
it, on every other pod), streaming its frames back; ``POST /cancel`` stops one.

A call's frames outlive the request that started it for a while (``streams.py``): a caller
that lost its stream attaches again and never runs the call twice.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from ktlite_server.bodies import discard_body, receive_body
from ktlite_server.callresponse import RAW_RESPONSE
from ktlite_server.coordinator import Coordinator
from ktlite_server.directbody import WRITE_CHUNK
from ktlite_server.keptoutcomes import kept
from ktlite_server.localcall import LOG_BODIES
from ktlite_server.localrun import run_local
from ktlite_server.pod import Pod
from ktlite_server.refusal import refuse
from ktlite_server.streams import RETAIN_S, AsgiOut, CallStream, Streams
from ktlite_wire import argfiles, codec, shm
from ktlite_wire.errors import ErrorCode, ProtocolError, WireError
from ktlite_wire.frames import RESULT, error_frame, frame_item
from ktlite_wire.headers import CALL_HEADER, RESUME_HEADER, UPTIME_HEADER
from ktlite_wire.outcome import CallResult
from ktlite_wire.plan import decode_plan
from ktlite_wire.status import Status

logger = logging.getLogger(__name__)


class StreamResponse(Response):
    """Carries a call's frames (from frame ``start`` on) to one HTTP response."""

    media_type = "application/x-ktlite-frames"

    def __init__(self, stream: CallStream, start: int) -> None:
        super().__init__(status_code=200, media_type=self.media_type)
        self.stream = stream
        self.start = start

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        extensions = scope.get("extensions") or {}
        raw = extensions.get(RAW_RESPONSE)
        out = raw(scope) if raw is not None else None  # the server's own writer, when it has one
        if out is None:
            write = extensions.get(WRITE_CHUNK)
            if write is not None:
                write = functools.partial(write, scope)
            out = AsgiOut(send, receive, write)
        await self.stream.send(out, self.start)


def _resume_from(request: Request) -> int | None:
    """The first frame a re-attaching caller lacks (None: a new call)."""
    value = request.headers.get(RESUME_HEADER)
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"{RESUME_HEADER} must be a frame number, got {value[:40]!r}")
    return int(value)


class FastCall:
    """The FastAPI app, with ``POST /call`` handed straight to its route handler.

    A warm call spends as long in the middleware stack and router as in everything else
    on the server; the handler and its errors are the same either way (the token was
    checked in front of both: ``admission.Gate``).
    """

    def __init__(self, app: FastAPI, call: Callable[[Request], Awaitable[Response]]) -> None:
        self.app = app
        self._call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/call":
            try:
                response = await self._call(Request(scope, receive))
            except HTTPException as e:
                response = JSONResponse(
                    {"detail": e.detail}, status_code=e.status_code, headers=e.headers
                )
            except ClientDisconnect:
                return  # the caller left mid-upload: nothing to answer, nothing ran
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _held(pod: Pod, call_id: str, path: str | None) -> int:
    """How many of this pod's ranks may still map the argument file of call ``call_id``
    (``path``; none without one): each rank's Result says whether it let go of it. Unknown
    outcomes (no local rank ran it, or its run was cut short) count as held."""
    if path is None:
        return 0
    outs = pod.finished.get(call_id)
    if not outs:
        return 1
    return sum(1 for o in kept(outs) if o.holds_args)


class Calls:
    """The calls this pod runs or coordinates."""

    def __init__(self, pod: Pod, token: str, max_body: int, started: float) -> None:
        self.pod = pod
        self.token = token
        self.max_body = max_body
        self.started = started  # when this server's process started (epoch seconds)
        self.streams = Streams()
        self.coordinators: dict[str, Coordinator] = {}  # the calls this pod coordinates, by id

    def __repr__(self) -> str:
        return f"Calls(pod={self.pod.name!r}, coordinating={len(self.coordinators)})"

    async def call(self, request: Request) -> Response:
        """``POST /call``: run a call here (and on the other pods, when this pod coordinates
        it), or attach a caller again to a call this pod holds."""
        pod, streams = self.pod, self.streams
        try:
            plan = decode_plan(request.headers.get(CALL_HEADER, ""))
            resume = _resume_from(request)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise refuse(
                400,
                ErrorCode.BAD_REQUEST,
                f"malformed {CALL_HEADER} header: {type(e).__name__}: {str(e)[:300]}",
            ) from e
        live = streams.get(plan.id)
        # a request for a call this pod holds attaches to it (once its first request told
        # whether it runs: its body may still be arriving)
        if live is not None and await live.decided():
            # the same call again (the caller lost its stream): never a second run
            await discard_body(request)
            return StreamResponse(live, resume or 0)
        if resume is not None:  # a re-attach: never runs anything
            await discard_body(request)
            if streams.ended_before(plan.id):
                raise refuse(
                    410,
                    ErrorCode.CALL_EXPIRED,
                    f"call {plan.id} ended on pod {pod.name} and its result is no "
                    f"longer kept (it waits {RETAIN_S:g}s for a caller to re-attach)",
                )
            raise refuse(
                404,
                ErrorCode.UNKNOWN_CALL,
                f"pod {pod.name} does not know call {plan.id}: its server restarted "
                "since the call began, and the call was lost with it",
            )
        if pod.dep is None:
            raise refuse(
                409,
                ErrorCode.NOT_DEPLOYED,
                f"pod {pod.name} has no code deployed: its server started after the "
                "deploy (a restarted container, a replaced pod); call .to() again, which "
                "pushes the code and reuses the pods",
                headers={UPTIME_HEADER: f"{max(0.0, time.time() - self.started):.3f}"},
            )
        if plan.launch_id and plan.launch_id != pod.dep.launch_id:
            raise refuse(
                409,
                ErrorCode.REDEPLOYED,
                f"pod {pod.name} runs launch {pod.dep.launch_id}, not the caller's "
                f"{plan.launch_id}: it was redeployed since (by another process, or it "
                "restarted); call .to() again",
            )
        coordinator = Coordinator(pod, self.token, pod.peers, plan) if plan.fanout else None

        def abandoned() -> None:
            if coordinator is not None:
                coordinator.cancel(Status.CANCELLED, "the caller disconnected")
            else:
                pod.cancel(plan.id, Status.CANCELLED, "the caller disconnected")

        stream = streams.open(plan.id, plan.reattach, abandoned)
        landed = None  # the file a large body landed in (this pod's: given back at the end)
        try:
            if plan.shm is None:
                body, landed = await receive_body(request, self.max_body, argfiles.process())
                path = None if landed is None else landed.path
            else:  # the caller shares this host and wrote the arguments to shared memory
                try:
                    path = shm.check(str(plan.shm[0]), shm.ARG_PREFIX)
                    body = shm.map_private(path, int(plan.shm[1]))
                except (ValueError, OSError, IndexError, TypeError) as e:
                    raise refuse(
                        400, ErrorCode.BAD_REQUEST, f"bad shared-memory argument: {e}"
                    ) from e
            try:
                if plan.per_rank is None:
                    codec.check(body)  # framing only: the server never unpickles user data
                else:  # the shared message, then this pod's ranks' items
                    view = memoryview(body).cast("B")
                    shared = plan.per_rank["shared"]
                    codec.check(view[:shared])
                    for off, n in plan.per_rank["items"]:
                        if off + n > view.nbytes:
                            raise ProtocolError(
                                f"per-rank item at {off}+{n} runs past the body "
                                f"({view.nbytes} bytes)"
                            )
            except ProtocolError as e:
                if landed is not None:  # no rank saw it
                    argfiles.process().give_back(landed, reusable=True)
                raise refuse(400, ErrorCode.BAD_REQUEST, f"malformed call body: {e}") from e
        except BaseException:
            streams.refused(stream)
            raise
        stream.decide(True)
        if LOG_BODIES:
            logger.info(
                "call %s: received %d bytes over HTTP",
                plan.id,
                memoryview(body).nbytes if plan.shm is None else 0,
            )
        coordinators = self.coordinators
        if coordinator is not None:
            coordinators[plan.id] = coordinator
            early = pod.cancelled_early.get(plan.id)
            if (
                early is not None
            ):  # the caller's cancel overtook the call: it starts stopped everywhere
                coordinator.cancel(*early)

        async def produce() -> None:
            held = 1  # unknown until the call's outcomes are in
            try:
                if (
                    coordinator is not None
                    and pod.dep is not None
                    and pod.dep.concurrency == 1
                    and pod.dep.config.world_size > 1
                ):
                    # collectives must run in the same order on every rank: a distributed
                    # deployment runs its calls one at a time, in the order they arrived here
                    async with pod.order:
                        result = await coordinator.run(body, path, stream.emit)
                elif coordinator is not None:
                    result = await coordinator.run(body, path, stream.emit)
                else:
                    result = CallResult(await run_local(pod, plan, body, path, stream.emit))
                # whether this pod's ranks let go of the argument file: the caller (on this
                # host) writes its next argument into the same file only when none holds it
                result.held = held = _held(pod, plan.id, path)
                if coordinator is not None and result.summary()[1]:
                    # a failed or stopped call may leave ranks out of step in their process
                    # group: the next call forms a new one (every rank, on a new port)
                    pod.next_generation()
                stream.emit(frame_item(RESULT, result.encode()))
            except Exception as e:  # noqa: BLE001 - infrastructure failure: tell the caller
                stream.emit(error_frame(WireError(ErrorCode.INTERNAL, str(e), type(e).__name__)))
            finally:
                if landed is not None:  # kept for the next argument when no rank maps it
                    argfiles.process().give_back(landed, reusable=held == 0)
                coordinators.pop(plan.id, None)
                streams.finished(stream)

        asyncio.get_running_loop().create_task(produce())
        return StreamResponse(stream, 0)

    def cancel(self, call_id: str, kind: Status, reason: str, reset: bool) -> bool:
        """Stop a call: on every pod when this pod coordinates it. False when no rank here
        was running it (then ``reset`` restarts a rank that is stuck)."""
        coordinator = self.coordinators.get(call_id)
        if coordinator is not None:  # this pod coordinates the call: stop it on every pod
            coordinator.cancel(kind, reason)
        found = self.pod.cancel(call_id, kind, reason)
        if not found and reset:
            self.pod.reset()
        return found
