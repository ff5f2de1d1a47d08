"""A pod's end of a link (``linkframes``): the calls another pod (or the caller, for its
submitted calls: ``ktlite.net.podlinks``) sends it over one persistent connection, each run exactly as a ``POST /call`` is (``Calls.call``: the same
checks, the same frame stream, the same re-attach and cancel rules), without an HTTP request,
an ASGI cycle and a response head per call.

A link is opened by ``POST /link`` on the pod server's port: the admission gate has checked the
deployment's token and the protocol version from the request head before it reaches here (TLS
where the server has it), and :func:`take_over` turns the connection into a :class:`LinkServer`.
A stream the caller closes (``CLOSE``), or a link that breaks, is a caller that disconnected:
its call is abandoned as an HTTP call's is when its connection closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.requests import Request

from ktlite_server import resultfeed
from ktlite_wire import envelope, frames, linkframes
from ktlite_wire.errors import ErrorCode, ProtocolError
from ktlite_wire.headers import CALL_HEADER, ERROR_CODE_HEADER
from ktlite_wire.heartbeat import HEARTBEAT_S

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from ktlite_server.streams import CallStream

logger = logging.getLogger(__name__)

TAKE_OVER = "ktlite.take_over"  # the ASGI scope extension: it(scope, make) -> bool
PIECE = 1 << 20  # a large frame leaves in messages of at most this many bytes
POST_MAX = 64 << 10  # an answer's last bytes up to this size leave with the others due now
# what a call over a link is handed to: the call's stream and its first frame (Calls.call)
Serve = Callable[[Request], Awaitable[Any]]
Run = Callable[["LinkServer", int, memoryview], None]  # a RUN's handler (memberrun)
StopCall = Callable[[linkframes.Stop], None]  # a STOP's handler (as POST /cancel's)


def take_over(http: HttpToolsProtocol, scope: Any, make: Callable[[Any], asyncio.Protocol]) -> bool:
    """Answer the request of ``scope`` with ``101`` and give its connection to the protocol
    ``make(transport)`` returns; False when the request is not the connection's current one
    or its answer has begun (then nothing changed)."""
    cycle = http.cycle
    if cycle is None or cycle.scope is not scope or cycle.response_started or cycle.disconnected:
        return False
    cycle.response_started = cycle.response_complete = True  # uvicorn writes nothing more
    cycle.message_event.set()
    cancel = getattr(http, "_cancel_head_timer", None)
    if cancel is not None:
        cancel()
    http.connections.discard(http)  # no longer an HTTP connection: not evicted, not drained
    transport = http.transport
    transport.write(linkframes.SWITCH)
    transport.set_protocol(make(transport))
    return True


class _Out:
    """One call's frames on the link (``streams.FrameOut``)."""

    def __init__(self, link: LinkServer, stream: int) -> None:
        self.link = link
        self.stream = stream
        self.closed = False  # the caller closed the stream, or the link broke
        self.failed = 0
        self._wake: Callable[[], None] | None = None
        self._head: bytes | None = None  # a late head: it leaves with the call's first frames

    @property
    def gone(self) -> bool:
        return self.closed or self.link.lost

    async def open(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        head = linkframes.head_message(self.stream, 200)
        if self.link.late_heads:
            self._head = head
        else:
            self.link.head([head])

    def disconnect(self) -> None:
        self.closed = True
        if self._wake is not None:
            self._wake()

    async def write(self, items: list[Any], last: bool) -> None:
        link = self.link
        out: list[Any] = []
        if self._head is not None:
            out, self._head = [self._head], None
        total = 0
        for i, item in enumerate(items):
            self.failed = i
            parts = item if isinstance(item, list) else [item]
            if link.paused:
                link.write(out)
                out = []
                await link.drain()
            if self.gone:
                return
            if resultfeed.growing(parts):  # a result its rank still writes: each run once written
                link.write(out)
                out = []
                async for run in resultfeed.written(parts):
                    await self._data(run)
                    if self.gone:
                        return
                continue
            size = envelope.parts_size(parts)
            if size <= PIECE:
                out += (linkframes.header(linkframes.DATA, self.stream, size), *parts)
                total += size
                continue
            link.write(out)
            out = []
            await self._data(parts)
        if last:
            out.append(linkframes.header(linkframes.END, self.stream, 0))
        if total <= POST_MAX:  # with the other answers due in this turn of the loop: one write
            link.post(out)
        else:
            link.write(out)

    async def _data(self, parts: list[Any]) -> None:
        """``parts`` as DATA messages of at most PIECE bytes, each once the link drained."""
        for part in parts:
            view = memoryview(part).cast("B")
            for i in range(0, view.nbytes, PIECE):
                if self.link.paused:
                    await self.link.drain()
                if self.gone:
                    return
                piece = view[i : i + PIECE]
                self.link.write(
                    [linkframes.header(linkframes.DATA, self.stream, piece.nbytes), piece]
                )

    def close(self) -> None:
        self._wake = None


async def send_frames(link: LinkServer, stream: int, items: list[Any]) -> None:
    """The rest of a stream whose head was written: ``items`` (frames), then its end."""
    out = link._outs[stream] = _Out(link, stream)
    try:
        await out.write(items, True)
    finally:
        link._outs.pop(stream, None)


class LinkServer(asyncio.Protocol):
    """A member pod's end of one link: ``serve`` runs each call (``Calls.call``)."""

    def __init__(
        self,
        transport: Any,
        serve: Serve,
        max_body: int,
        idle_s: float,
        run: Run | None = None,
        late_heads: bool = False,
        stop: StopCall | None = None,
    ) -> None:
        self.transport = transport
        # a caller's link (``?heads=late``): a call's 200 head leaves with its first frames, one
        # wake of the caller where the head woke it alone (it does not need the head to tell
        # whether a call reached the pod: ``ktlite.net.podlinks``); a pod's peer does
        self.late_heads = late_heads
        self.serve = serve
        self.run = run  # a RUN's handler (memberrun)
        self.stop = stop  # a STOP's: the call stopped as POST /cancel stops it
        self._stops: dict[int, Callable[[], None]] = {}  # the RUNs under way: their stop
        self._beat: asyncio.TimerHandle | None = None
        self.max_body = max_body
        self.idle_s = idle_s  # a link without a call this long is closed (KTLITE_IDLE_TIMEOUT)
        self.lost = False
        self._active = 0  # calls on the link (from their CALL to the end of their answer)
        self._last = time.monotonic()
        self._idle = asyncio.get_running_loop().call_later(idle_s, self._idle_check)
        self.paused = False
        self._drained: asyncio.Event | None = None
        self._reader = linkframes.Reader()
        self._posted: list[Any] = []  # bytes due at the end of this turn of the loop (post)
        self._flush_due = False  # a callback that writes them is queued
        self._outs: dict[int, _Out] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"LinkServer({len(self._outs)} streams, lost={self.lost})"

    def write(self, parts: list[Any]) -> None:
        """``parts`` now, after what was posted (in order)."""
        if self._posted:
            parts, self._posted = self._posted + parts, []
        if parts and not self.lost:
            self.transport.writelines(parts)

    def post(self, parts: list[Any]) -> None:
        """``parts`` at the end of this turn of the event loop, in one write with the others
        posted meanwhile (answers that end together: one system call, one wake of the reader)."""
        self._flush_soon()
        self._posted += parts

    def head(self, parts: list[Any]) -> None:
        """A call's head: with the write already due (it runs before any callback queued from
        now on, the call's own work included: the head still leaves before its ranks have the
        call), else now."""
        if self._flush_due:
            self._posted += parts
        else:
            self.write(parts)

    def _flush_soon(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        self.write([])

    async def drain(self) -> None:
        while self.paused and not self.lost:
            if self._drained is None:
                self._drained = asyncio.Event()
            await self._drained.wait()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    def data_received(self, data: bytes) -> None:
        calls = False
        try:
            for kind, stream, payload in self._reader.feed(data):
                if kind == linkframes.CALL:
                    task = asyncio.get_running_loop().create_task(self._call(stream, payload))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    calls = True
                elif kind == linkframes.RUN and self.run is not None:
                    self.run(self, stream, payload)
                elif kind == linkframes.STOP and self.stop is not None:
                    self.stop(linkframes.split_stop(payload))
                elif kind == linkframes.CLOSE:
                    out = self._outs.get(stream)
                    if out is not None:
                        out.disconnect()
                    stop = self._stops.get(stream)
                    if stop is not None:
                        stop()
                else:
                    raise ProtocolError(f"a link message of kind {kind} from the caller's side")
            if calls:  # queued after the calls' first steps: their heads leave in one write
                self._flush_soon()
        except ProtocolError as e:
            logger.warning("closed a peer link that sent a malformed message: %s", e)
            self.transport.abort()

    def _idle_check(self) -> None:
        """Close a link idle for ``idle_s`` (its pod went away without closing it, or stopped
        calling): the other end opens a new one for its next call, as for an HTTP keep-alive
        connection closed meanwhile. Checked lazily: no timer per call."""
        idle = time.monotonic() - self._last
        if self._active or idle < self.idle_s:
            wait = self.idle_s - (0.0 if self._active else idle)
            self._idle = asyncio.get_running_loop().call_later(wait, self._idle_check)
            return
        logger.debug("closed a peer link idle for %.0fs", idle)
        # what arrives after this is never read: the other end sends it again (linkframes)
        self.write([linkframes.header(linkframes.GOAWAY, 0, 0)])
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._idle.cancel()
        self.resume_writing()  # wakes a writer that waits for the link to drain
        for out in list(self._outs.values()):
            out.disconnect()
        for stop in list(self._stops.values()):
            stop()

    def begin(self, stream: int, stop: Callable[[], None]) -> None:
        """A RUN began on ``stream``; ``stop`` abandons it (CLOSE, or the link broke)."""
        self._active += 1
        self._stops[stream] = stop
        if self._beat is None:  # one timer for every RUN under way, not one per call
            self._beat = asyncio.get_running_loop().call_later(HEARTBEAT_S, self._heartbeat)

    def _heartbeat(self) -> None:
        """A heartbeat frame on each RUN's stream, every HEARTBEAT_S while any runs."""
        if not self._stops or self.lost:
            self._beat = None
            return
        beat = frames.frame(frames.HEARTBEAT, b"")
        self.write([linkframes.header(linkframes.DATA, n, len(beat)) + beat for n in self._stops])
        self._beat = asyncio.get_running_loop().call_later(HEARTBEAT_S, self._heartbeat)

    def finish(self, stream: int) -> None:
        self._active -= 1
        self._last = time.monotonic()
        self._stops.pop(stream, None)

    async def _call(self, stream: int, payload: memoryview) -> None:
        self._active += 1
        try:
            await self._run(stream, payload)
        finally:
            self._active -= 1
            self._last = time.monotonic()

    async def _run(self, stream: int, payload: memoryview) -> None:
        try:
            meta, body = linkframes.split_call(payload)
        except (ProtocolError, UnicodeDecodeError) as e:
            self.refuse(stream, 400, ErrorCode.BAD_REQUEST.value, f"malformed link call: {e}")
            return
        if body.nbytes > self.max_body:
            self.refuse(
                stream,
                413,
                ErrorCode.TOO_LARGE.value,
                f"body of {body.nbytes} bytes is larger than this server's limit of "
                f"{self.max_body} bytes (KTLITE_MAX_BODY)",
            )
            return
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/call",
            "query_string": b"",
            "headers": [
                (CALL_HEADER.encode(), meta.encode()),
                (b"content-length", str(body.nbytes).encode()),
            ],
        }
        try:
            response = await self.serve(Request(scope, receive))
        except HTTPException as e:
            code = (e.headers or {}).get(ERROR_CODE_HEADER, "")
            self.refuse(stream, e.status_code, code, str(e.detail))
            return
        except Exception as e:  # noqa: BLE001 - an infrastructure failure: the caller hears it
            logger.exception("a call over a peer link failed before it started")
            self.refuse(stream, 500, ErrorCode.INTERNAL.value, f"{type(e).__name__}: {e}")
            return
        call: CallStream = response.stream
        out = self._outs[stream] = _Out(self, stream)
        try:
            await call.send(out, response.start)
        finally:
            self._outs.pop(stream, None)

    def refuse(self, stream: int, status: int, code: str, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        self.write([linkframes.head_message(stream, status, code, body)])


class Links:
    """ASGI: ``POST /link`` becomes a link (behind the admission gate, which checked the token
    and version); every other request goes on to ``app``."""

    def __init__(
        self,
        app: Any,
        serve: Serve,
        max_body: int,
        idle_s: float,
        run: Run | None = None,
        stop: StopCall | None = None,
    ) -> None:
        self.app = app
        self.serve = serve
        self.run = run
        self.stop = stop
        self.max_body = max_body
        self.idle_s = idle_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != linkframes.PATH:
            await self.app(scope, receive, send)
            return
        take = (scope.get("extensions") or {}).get(TAKE_OVER)
        if (
            scope["method"] == "POST"
            and take is not None
            and take(
                scope,
                lambda t: LinkServer(
                    t,
                    self.serve,
                    self.max_body,
                    self.idle_s,
                    self.run,
                    late_heads=b"heads=late" in scope.get("query_string", b""),
                    stop=self.stop,
                ),
            )
        ):
            return
        detail = (
            "a peer link is opened with POST on a pod server's own connection"
            if scope["method"] == "POST"
            else f"{scope['method']} {linkframes.PATH}: a peer link is opened with POST"
        )
        body = json.dumps({"detail": detail}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"application/json"),
                    (ERROR_CODE_HEADER.encode(), ErrorCode.BAD_REQUEST.value.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
