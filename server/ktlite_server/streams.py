"""A call's frame stream, kept apart from the HTTP response that carries it.

A call through the Kubernetes API server's pod proxy can lose its connection while it runs
(Go's HTTP/1 reverse proxy drops its backend connection in a race; load balancers cut long
streams). The call keeps running: its frames (logs, notices, the result) are numbered and
kept here, and the caller re-attaches by call id (``POST /call`` again, with the
``x-ktlite-resume`` header naming the first frame it lacks, and no body) and reads on. A call
is never run twice: a request whose call id this pod already holds attaches to the call, and a
re-attach to a call it does not hold is refused.

Callers that reach the pod directly (the local backend, in-cluster clients) ask for no
re-attach window: when their connection closes the call is cancelled at once, as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ktlite_server import resultfeed
from ktlite_wire import envelope, frames
from ktlite_wire.errors import ErrorCode, WireError
from ktlite_wire.heartbeat import HEARTBEAT_S

logger = logging.getLogger(__name__)

LOG_BUFFER_BYTES = 8 << 20  # frames kept for a re-attach; older log lines are dropped first
RETAIN_S = 30.0  # a finished call's frames wait this long for a caller that lost its stream
RETAIN_BYTES = 512 << 20  # at most this much of finished calls' frames is kept
JOIN_MAX = frames.JOIN_MAX  # frames up to this size leave in one piece (larger: in chunks)


def _size(item: Any) -> int:
    if isinstance(item, list):
        return envelope.parts_size(item)
    return len(item)


class CallStream:
    """The frames of one call, readable from any frame on, by one response at a time or more."""

    def __init__(self, call_id: str, reattach_s: float, on_abandon: Callable[[], None]) -> None:
        self.id = call_id
        self.reattach_s = reattach_s
        self.on_abandon = on_abandon
        self.frames: collections.deque[Any] = collections.deque()
        self.base = 0  # the number of the oldest frame still kept
        self.kept_bytes = 0
        self.done = False
        self.finished_at = 0.0
        self.attached = 0
        self.accepted: bool | None = None  # None while its first request's body arrives
        self._decided: asyncio.Event | None = None  # made only for a duplicate that waits
        self._changed: asyncio.Event | None = None  # made only when a reader waits
        self._abandon: asyncio.TimerHandle | None = None

    @property
    def end(self) -> int:
        return self.base + len(self.frames)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def decide(self, accepted: bool) -> None:
        """The first request's body arrived and the call started (or it failed)."""
        self.accepted = accepted
        if self._decided is not None:
            self._decided.set()

    async def decided(self) -> bool:
        """Whether the call runs, once its first request has told."""
        if self.accepted is None:
            if self._decided is None:
                self._decided = asyncio.Event()
            await self._decided.wait()
        return bool(self.accepted)

    def emit(self, item: Any) -> None:
        """Append a frame (bytes, or a list of parts); wakes the readers."""
        self.frames.append(item)
        self.kept_bytes += _size(item)
        while self.kept_bytes > LOG_BUFFER_BYTES and len(self.frames) > 1:
            self.kept_bytes -= _size(self.frames.popleft())
            self.base += 1
        self._wake()

    def finish(self) -> None:
        self.done = True
        self.finished_at = time.monotonic()
        if self._abandon is not None:
            self._abandon.cancel()
        self._wake()

    def _lost(self, number: int, error: resultfeed.ResultLost) -> None:
        """Frame ``number``'s result could not be read whole (its rank died writing it): the
        response that carried it is cut off mid-frame (raised on), and a caller that attaches
        again reads the cause in its place."""
        logger.error("call %s: %s; the caller's stream is cut off", self.id, error)
        if self.base <= number < self.end:
            old = self.frames[number - self.base]
            self.frames[number - self.base] = item = frames.error_frame(
                WireError(ErrorCode.INTERNAL, str(error), "ResultLost")
            )
            self.kept_bytes += len(item) - _size(old)

    def _detached(self) -> None:
        if self.done or self.attached:
            return
        if self.reattach_s <= 0:
            self.on_abandon()
            return
        self._abandon = asyncio.get_running_loop().call_later(self.reattach_s, self._give_up)

    def _give_up(self) -> None:
        if not self.done and not self.attached:
            self.on_abandon()

    async def send(self, out: FrameOut, start: int) -> None:
        """Stream frames ``start...`` to one response (``out``), heartbeats while idle, until
        the call ends (then the response ends) or the caller disconnects. The frames that are
        due go to ``out`` together (the server's own writer sends them in one write)."""
        loop = asyncio.get_running_loop()
        self.attached += 1
        if self._abandon is not None:
            self._abandon.cancel()
            self._abandon = None
        beat_due = False
        heart: asyncio.TimerHandle  # set below, once beat exists

        def beat() -> None:  # a timer, not a task: most calls end long before the first beat
            nonlocal beat_due, heart
            beat_due = True
            self._wake()
            heart = loop.call_later(HEARTBEAT_S, rearm[0])

        # beat re-arms itself through this list, emptied at the end: named in its own closure
        # it made a cycle that held this stream, and a result's memory in its frames, until
        # the collector ran
        rearm = [beat]
        heart = loop.call_later(HEARTBEAT_S, beat)
        at = start
        try:
            await out.open(self._wake)
            while not out.gone:
                batch: list[Any] = []
                if at < self.base:
                    # older frames were dropped (the caller was away, or slow, while more than
                    # the buffer was written): say where the stream goes on, so the caller's
                    # count of frames stays the pod's
                    batch.append(
                        frames.notice_frame(
                            "skip",
                            f"{self.base - at} frame(s) of log lines were dropped",
                            to=self.base,
                        )
                    )
                    at = self.base
                if at < self.end:
                    batch.extend(itertools.islice(self.frames, at - self.base, None))
                    at = self.end
                last = self.done and at == self.end
                if batch or last:
                    try:
                        await out.write(batch, last)
                    except resultfeed.ResultLost as e:  # batch[out.failed] is frame at - (len - i)
                        self._lost(at - (len(batch) - out.failed), e)
                        raise
                    if last:
                        return
                    continue
                if beat_due:
                    beat_due = False
                    await out.write([frames.frame(frames.HEARTBEAT, b"")], False)
                    continue
                if self._changed is None:  # nothing awaited between the checks and here
                    self._changed = asyncio.Event()
                await self._changed.wait()
        finally:
            out.close()
            heart.cancel()
            rearm.clear()
            self.attached -= 1
            self._detached()


class FrameOut(Protocol):
    """Where :meth:`CallStream.send` writes one response's frames: :class:`AsgiOut` (through
    the ASGI ``send``), or the pod server's own writer on its connection
    (``callresponse.RawOut``)."""

    @property
    def gone(self) -> bool:
        """The caller disconnected: nothing more can be written."""
        ...

    @property
    def failed(self) -> int:
        """The index, in the last ``write``'s items, of the frame it failed on."""
        ...

    async def open(self, wake: Callable[[], None]) -> None:
        """Begin: from now on call ``wake`` when the caller disconnects."""
        ...

    async def write(self, items: list[Any], last: bool) -> None:
        """Write frames (each bytes, or a list of parts); ``last``: the response ends after."""
        ...

    def close(self) -> None:
        """Stop watching the connection (the response ended, or its reader did)."""
        ...


class AsgiOut:
    """A call's frames through ASGI ``send`` messages: the head at once, a message per frame;
    a task awaits ``receive`` to learn of a disconnect. ``write_chunk``: the server's way to
    write a large frame's parts as one chunk, uncopied (``directbody.write_chunk``)."""

    def __init__(self, send: Any, receive: Any, write_chunk: Any = None) -> None:
        self._send = send
        self._receive = receive
        self._write_chunk = write_chunk
        self._watcher: asyncio.Task[None] | None = None
        self.gone = False
        self.failed = 0

    async def open(self, wake: Callable[[], None]) -> None:
        async def watch() -> None:
            while True:
                msg = await self._receive()
                if msg["type"] == "http.disconnect":
                    self.gone = True
                    wake()
                    return

        self._watcher = asyncio.get_running_loop().create_task(watch())
        await self._send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/x-ktlite-frames")],
            }
        )

    async def write(self, items: list[Any], last: bool) -> None:
        if not items:
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        for i, item in enumerate(items):
            self.failed = i
            more = not (last and i == len(items) - 1)
            await _send(self._send, item, more=more, write=self._write_chunk)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


async def _send(send: Any, item: Any, more: bool, write: Any = None) -> None:
    if type(item) is bytes and len(item) <= JOIN_MAX:  # a frame joined when it was made
        await send({"type": "http.response.body", "body": item, "more_body": more})
        return
    parts = item if isinstance(item, list) else [item]
    if envelope.parts_size(parts) <= JOIN_MAX:  # one write, not one per part
        await send({"type": "http.response.body", "body": b"".join(parts), "more_body": more})
        return
    if write is not None and resultfeed.growing(parts):
        # a result its rank still writes: each piece as it is written, a chunk each
        wrote = False
        async with contextlib.aclosing(resultfeed.written(parts)) as runs:
            async for run in runs:
                if not await write(run):
                    if wrote:
                        return  # the caller left mid-frame
                    break  # the writer cannot: the frame goes at once, below
                wrote = True
            else:
                if not more:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
    if write is not None and await write(parts):  # one chunk, its parts as they are
        if not more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await resultfeed.complete(parts)  # sent at once: a result its rank still writes, once written
    chunks: list[bytes | memoryview] = [*envelope.chunked(parts)] or [b""]
    for i, chunk in enumerate(chunks):
        await send(
            {"type": "http.response.body", "body": chunk, "more_body": more or i < len(chunks) - 1}
        )


class Streams:
    """The calls this pod coordinates, by call id; finished ones kept a while for re-attach."""

    def __init__(self) -> None:
        self.live: dict[str, CallStream] = {}
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()

    def get(self, call_id: str) -> CallStream | None:
        self._expire()
        return self.live.get(call_id)

    def ended_before(self, call_id: str) -> bool:
        """True if this pod ran the call and no longer keeps its frames."""
        return call_id in self.ended

    def open(self, call_id: str, reattach_s: float, on_abandon: Callable[[], None]) -> CallStream:
        stream = CallStream(call_id, reattach_s, on_abandon)
        self.live[call_id] = stream
        return stream

    def refused(self, stream: CallStream) -> None:
        """The request that opened ``stream`` failed before its call started."""
        if self.live.get(stream.id) is stream:
            del self.live[stream.id]
        if stream.accepted is None:
            stream.decide(False)

    def finished(self, stream: CallStream) -> None:
        stream.finish()
        if stream.reattach_s <= 0:
            if self.live.get(stream.id) is stream:
                self._forget(stream.id)
            return
        # kept for a caller that lost its stream; dropped by the next call after RETAIN_S, or here
        asyncio.get_running_loop().call_later(RETAIN_S + 1.0, self._expire)

    def _forget(self, call_id: str) -> None:
        self.live.pop(call_id, None)
        self.ended[call_id] = None
        while len(self.ended) > 4096:
            self.ended.popitem(last=False)

    def _expire(self) -> None:
        now = time.monotonic()
        done = [s for s in self.live.values() if s.done]
        kept = sum(s.kept_bytes for s in done)
        for s in sorted(done, key=lambda s: s.finished_at):
            if s.attached:
                continue
            if now - s.finished_at > RETAIN_S or kept > RETAIN_BYTES:
                kept -= s.kept_bytes
                self._forget(s.id)

    def close(self) -> None:
        for stream in self.live.values():
            with contextlib.suppress(Exception):
                stream.finish()
        self.live.clear()
