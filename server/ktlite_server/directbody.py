"""Large bodies past uvicorn: a request body read straight into where it goes, and a
response chunk written from its parts as they are.

uvicorn hands a body to the app in ``receive()`` messages, and each byte is copied four
times on the way (the event loop's read buffer to ``bytes``, httptools' body slice, the
cycle's ``bytearray``, the message's ``bytes``) before the app copies it a fifth time into
its own buffer: about 0.7 GB/s for a 100 MB argument here. For a body of at least
:data:`DIRECT_MIN` bytes the pod server's protocol (``connections.GuardedHttpTools``) offers
the app another way, in the ASGI scope's extensions under :data:`BODY_INTO`: an awaitable
that hands the connection for the rest of the body to a :class:`BodyInto`, an
``asyncio.BufferedProtocol`` whose ``get_buffer`` gives the transport the destination itself
(a :class:`MemorySink`: the bytes land there, no copy by Python) or a reused piece that is
written on to a file (a :class:`FileSink`: the shared-memory file a rank maps). When the body
is complete the connection goes back to the HTTP protocol, with a fresh parser (the old one
never saw the body's bytes), and the request goes on as if uvicorn had read it.

The other way, uvicorn joins each chunk of a chunked response into one new ``bytes`` (its size
line, the body, CRLF): a copy of every byte of a large result. For ``POST /call`` the
protocol offers :data:`WRITE_CHUNK`, :func:`write_chunk`: one chunk from a list of buffers,
handed to the transport as views of them (uvloop queues a view, it does not copy it), each
after waiting for the transport to drain, as uvicorn's own ``send`` does.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import TYPE_CHECKING, Any, Protocol

import httptools
from starlette.requests import ClientDisconnect

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

BODY_INTO = "ktlite.body_into"  # the ASGI scope extension: await it(scope, length, sink)
WRITE_CHUNK = "ktlite.write_chunk"  # the ASGI scope extension: await it(scope, parts)
DIRECT_MIN = 64 << 10  # smaller bodies go through uvicorn's receive() as before
PIECE = 1 << 20  # a FileSink's reused buffer
WRITE_PIECE = 4 << 20  # write_chunk hands the transport this much at a time


class Sink(Protocol):
    """Where a body's bytes go: ``buffer()`` is where the next ones are read into (never empty
    while some are due), ``filled(n)`` says ``n`` of them arrived there."""

    def buffer(self) -> memoryview: ...

    def filled(self, n: int) -> None: ...


class MemorySink:
    """Into ``view``, from its start: the transport reads straight into it."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def buffer(self) -> memoryview:
        return self.view[self.pos :]

    def filled(self, n: int) -> None:
        self.pos += n


class FileSink:
    """Onto the open file ``fd``, from its start, through one reused piece of memory (a write
    to a tmpfs file costs less than page faults on a fresh mapping of it)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.pos = 0
        self.left = size
        self.piece = memoryview(bytearray(min(PIECE, max(size, 1))))

    def buffer(self) -> memoryview:
        return self.piece[: min(self.piece.nbytes, self.left)]

    def close(self) -> None:
        """Write nothing more (the file went back, or away): a byte still arriving fails the
        body (``BodyInto`` aborts the connection) instead of landing in a file reused."""
        self.fd = -1

    def filled(self, n: int) -> None:
        if self.fd < 0:
            raise OSError(errno.EBADF, "the body's file was given up before its end arrived")
        data = self.piece[:n]
        while data:
            k = os.pwrite(self.fd, data, self.pos)
            self.pos += k
            data = data[k:]
        self.left -= n


def put(sink: Sink, data: bytes | bytearray) -> None:
    """Bytes that arrived before the sink took over, through the sink's own buffers."""
    view = memoryview(data)
    while view:
        buf = sink.buffer()
        n = min(buf.nbytes, view.nbytes)
        buf[:n] = view[:n]
        sink.filled(n)
        view = view[n:]


class BodyInto(asyncio.BufferedProtocol):
    """Holds a connection while ``left`` more bytes of a request body arrive into ``sink``;
    then gives it back to ``http`` and resolves ``done`` (or fails it, with
    ``ClientDisconnect``, when the connection is lost first)."""

    def __init__(
        self, http: HttpToolsProtocol, sink: Sink, left: int, done: asyncio.Future[None]
    ) -> None:
        self.http = http
        self.sink = sink
        self.left = left
        self.done = done

    def get_buffer(self, sizehint: int) -> memoryview:
        buf = self.sink.buffer()
        return buf[: self.left] if buf.nbytes > self.left else buf

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.sink.filled(nbytes)
        except OSError as e:  # the file could not take it (a full /dev/shm)
            if not self.done.done():
                self.done.set_exception(e)
            self.http.transport.abort()
            return
        self.left -= nbytes
        if self.left == 0:
            _give_back(self.http)
            if not self.done.done():
                self.done.set_result(None)

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ClientDisconnect())
        self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()


def _give_back(http: HttpToolsProtocol) -> None:
    """The body is in: the connection reads HTTP again, with a parser at a message's start."""
    http.transport.set_protocol(http)
    http.parser = httptools.HttpRequestParser(http)
    http.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's own
    cycle = http.cycle
    cycle.more_body = False
    cycle.message_event.set()


async def receive_into(http: HttpToolsProtocol, scope: Any, length: int, sink: Sink) -> bool:
    """Read the body of the request of ``scope`` (``length`` bytes, its Content-Length) into
    ``sink``, if that request is the connection's current one and nothing of its body has
    been taken through ``receive()`` yet (await this first); False (nothing read) otherwise:
    then read it through ``receive()``. Raises ClientDisconnect when the connection goes
    first."""
    cycle = http.cycle
    if cycle is None or cycle.scope is not scope:
        return False
    if cycle.disconnected:
        raise ClientDisconnect()
    early, cycle.body = cycle.body, bytearray()  # parsed before the app asked: not read yet
    put(sink, early)
    if not cycle.more_body:  # the parser had all of it
        return True
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    http.transport.set_protocol(BodyInto(http, sink, length - len(early), done))
    http.flow.resume_reading()  # uvicorn paused it while the body waited for the app
    await done
    return True


async def write_chunk(http: HttpToolsProtocol, scope: Any, parts: list[Any]) -> bool:
    """Write ``parts`` as one chunk of ``cycle``'s chunked response, uncopied, in pieces of at
    most :data:`WRITE_PIECE` bytes, each after the transport has drained (so a TLS transport,
    which encrypts what it is given at once, holds one piece at a time). False (nothing
    written) when that is not possible now: the response has not started, is not chunked, or
    is over, or the caller left; the caller then sends through ``send`` as usual."""
    cycle = http.cycle
    if (
        cycle is None
        or cycle.scope is not scope
        or cycle.disconnected
        or cycle.response_complete
        or not cycle.response_started
        or not cycle.chunked_encoding
    ):
        return False
    size = 0
    for p in parts:
        size += memoryview(p).nbytes
    http.transport.write(b"%x\r\n" % size)
    for part in parts:
        view = memoryview(part).cast("B")
        for i in range(0, view.nbytes, WRITE_PIECE):
            if cycle.flow.write_paused:
                await cycle.flow.drain()
            if cycle.disconnected:  # the transport is closed: the rest goes nowhere
                return True
            http.transport.write(view[i : i + WRITE_PIECE])
    http.transport.write(b"\r\n")
    return True
