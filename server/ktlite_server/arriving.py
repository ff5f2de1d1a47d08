"""A call's body while it still arrives: pod 0 forwards it to the other pods piece by piece.

A large call body lands in a shared-memory file (``bodies``, ``directbody.FileSink``). Pod 0
used to forward it to the other pods only once all of it was there: for 100 MB the members'
transfer began where the caller's ended. With an :class:`Arriving` the call goes on as soon as
the body's framing is in (checked as before: the head and buffer table say how the rest is
laid out, and nothing is unpickled): the coordinator's posts to the other pods send each
piece once it landed (``peers.PeerPool.post``), and this pod's own ranks get the call once the
body is whole. The response to the caller begins only then too, so a caller whose upload
breaks still learns that nothing ran.

A body cut short fails the :class:`Arriving`: every post still sending it breaks off its
connection mid-body (that pod runs nothing), and the call ends there. Memory stays bounded:
the bytes are read from the file (which this pod's ranks map anyway), each post writes one
piece at a time and waits for its connection to drain, so a slow pod holds up its own post
and nothing else.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from typing import Any

from starlette.requests import ClientDisconnect, Request

from ktlite_server import directbody
from ktlite_wire import argfiles, envelope, shm
from ktlite_wire.argfiles import ArgFile

PIECE = directbody.PIECE  # a post waits for this much more of the body before it writes


class Arriving:
    """How much of a body of ``size`` bytes has landed (``have``); awaitable."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.have = 0
        self.error: BaseException | None = None
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []

    def __repr__(self) -> str:
        return f"Arriving({self.have} of {self.size} bytes{', failed' if self.error else ''})"

    def add(self, n: int) -> None:
        """``n`` more bytes landed (the sink's ``filled``)."""
        self.have += n
        if self._waiting:
            self._wake()

    def fail(self, error: BaseException) -> None:
        """The body will not arrive whole (the caller left): every wait raises ``error``."""
        if self.error is None and self.have < self.size:
            self.error = error
            self._wake()

    def _wake(self) -> None:
        still = []
        for n, fut in self._waiting:
            if fut.done():
                continue
            if self.error is not None:
                fut.set_exception(self.error)
            elif self.have >= n:
                fut.set_result(None)
            else:
                still.append((n, fut))
        self._waiting = still

    async def until(self, n: int) -> None:
        """Return once ``n`` bytes (at most the size) have landed; raises the failure."""
        n = min(n, self.size)
        if self.have >= n:
            return
        if self.error is not None:
            raise self.error
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((n, fut))
        await fut

    async def whole(self) -> None:
        await self.until(self.size)


async def streamed(arriving: Arriving | None, body: Any) -> Arriving | None:
    """``arriving`` when ``body`` (a post's) is the whole body, sent as it lands; else (a
    per-rank call's cut of it, pieces from anywhere in it) None, once it is whole."""
    if arriving is not None and not isinstance(body, memoryview):
        await arriving.whole()
        return None
    return arriving


class _Counted:
    """A sink that says what landed in it (``directbody.Sink``)."""

    def __init__(self, sink: directbody.FileSink, arriving: Arriving) -> None:
        self.sink = sink
        self.arriving = arriving

    def buffer(self) -> memoryview:
        return self.sink.buffer()

    def filled(self, n: int) -> None:
        self.sink.filled(n)
        self.arriving.add(n)


async def receive_arriving(
    request: Request, n: int
) -> tuple[memoryview, ArgFile, Arriving, asyncio.Task[bool]] | None:
    """Start reading the large body (``n`` bytes, its Content-Length) of ``request`` into an
    argument file (``argfiles.process()``) through the server's protocol, and return once its
    framing is in: its mapping, the file, the :class:`Arriving` and the task that reads the
    rest (it fails the Arriving, and raises, when the body is cut short). None when the
    protocol cannot take it (nothing read: then read it whole, as ever)."""
    into = request.scope.get("extensions", {}).get(directbody.BODY_INTO)
    if into is None or n <= shm.INLINE_MAX or "content-length" not in request.headers:
        return None
    files = argfiles.process()
    landed = files.take(n)
    arriving = Arriving(n)
    file_sink = directbody.FileSink(landed.fd, n)
    sink = _Counted(file_sink, arriving)
    reading: asyncio.Task[bool] = asyncio.ensure_future(into(request.scope, n, sink))

    def ended(t: asyncio.Task[bool]) -> None:
        if t.cancelled() or t.exception() is not None or not t.result():
            arriving.fail((None if t.cancelled() else t.exception()) or ClientDisconnect())

    reading.add_done_callback(ended)
    try:
        await arriving.until(envelope.HEAD.size)
        (nbufs,) = envelope.HEAD.unpack_from(os.pread(landed.fd, envelope.HEAD.size, 0))[2:3]
        await arriving.until(envelope.HEAD.size + 8 * min(nbufs, envelope.MAX_BUFFERS + 1))
    except BaseException:
        file_sink.close()  # nothing more lands in it: it goes back (no rank saw it)
        if not reading.done():
            reading.cancel()
        files.give_back(landed, reusable=True)
        taken = not reading.done() or reading.cancelled() or reading.exception() is not None
        if not taken and not reading.result():
            return None  # the protocol could not take it: nothing was read
        raise
    return memoryview(mmap.mmap(landed.fd, n)), landed, arriving, reading
