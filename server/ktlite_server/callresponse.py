"""A call's HTTP response written by the pod server itself, straight to its connection.

Through ASGI a call's answer costs the pod server a task that awaits ``receive()`` only to
learn of a disconnect, and uvicorn's checks, header building and socket write for each
message: a frame a write. :class:`RawOut` writes the same bytes (a chunked ``200`` response
of frames, ``ktlite_wire.frames``) on the connection's transport: the head at once (a caller
takes a head as "the pod has the call": a connection that breaks before it is sent again),
then every frame that is due in one write, the chunked body's end with the last ones; a
disconnect is learnt from the protocol's ``connection_lost``
(``connections.GuardedHttpTools``), not from a task.

The pod server's protocol offers it for ``POST`` requests in the ASGI scope's extensions under
:data:`RAW_RESPONSE`; anything else (an app under another server, a test client) answers
through ``send`` as before (``streams.AsgiOut``). What travels is the same either way, so
every client and proxy (the Kubernetes API server's) reads it as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ktlite_server import directbody, resultfeed
from ktlite_wire import envelope
from ktlite_wire.frames import JOIN_MAX

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

RAW_RESPONSE = "ktlite.raw_response"  # the ASGI scope extension: it(scope) -> RawOut | None

_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: application/x-ktlite-frames\r\n"
    b"transfer-encoding: chunked\r\n"
)
_END = b"0\r\n\r\n"


class Lost:
    """What a connection calls when it is lost: the current response's hook, if any (one
    response at a time per HTTP/1.1 connection)."""

    def __init__(self) -> None:
        self.hook: Callable[[], None] | None = None

    def __call__(self) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


class RawOut:
    """One call response on ``http``'s connection, for the request ``cycle``
    (``streams.FrameOut``)."""

    def __init__(self, http: HttpToolsProtocol, cycle: RequestResponseCycle, lost: Lost) -> None:
        self.http = http
        self.cycle = cycle
        self._lost = lost
        self._wake: Callable[[], None] | None = None
        self.failed = 0  # the index of the frame the last write failed on

    @property
    def gone(self) -> bool:
        return self.cycle.disconnected

    async def open(self, wake: Callable[[], None]) -> None:
        self._wake = self._lost.hook = wake
        self.http.transport.write(self._head())

    def close(self) -> None:
        if self._wake is not None and self._lost.hook is self._wake:
            self._lost.hook = None

    def _head(self) -> bytes:
        cycle = self.cycle
        cycle.response_started = True
        cycle.chunked_encoding = True
        cycle.waiting_for_100_continue = False
        return _HEAD + (b"\r\n" if cycle.keep_alive else b"connection: close\r\n\r\n")

    async def write(self, items: list[Any], last: bool) -> None:
        cycle = self.cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        out: list[Any] = []
        for i, item in enumerate(items):
            self.failed = i
            if type(item) is bytes and len(item) <= JOIN_MAX:
                out += (b"%x\r\n" % len(item), item, b"\r\n")
                continue
            parts = item if isinstance(item, list) else [item]
            size = envelope.parts_size(parts)
            if size <= JOIN_MAX:
                out += (b"%x\r\n" % size, *parts, b"\r\n")
                continue
            # a large frame: its parts as they are, after what is due before it
            if out:
                self.http.transport.write(b"".join(out))
                out = []
            if resultfeed.growing(parts):
                # a result its rank still writes: each piece as it is written, a chunk each
                # (ResultLost when the rank died writing it: the response is cut off)
                async with contextlib.aclosing(resultfeed.written(parts)) as runs:
                    async for run in runs:
                        if not await directbody.write_chunk(self.http, cycle.scope, run):
                            return  # the caller left mid-frame
            elif not await directbody.write_chunk(self.http, cycle.scope, parts):
                return  # the caller left
            if cycle.disconnected:
                return
        if last:
            out.append(_END)
        if out:
            self.http.transport.write(b"".join(out))
        if last:
            self._complete()

    def _complete(self) -> None:
        """The response is over: the connection takes its next request (as uvicorn's ``send``
        does after a final message)."""
        cycle = self.cycle
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.http.transport.close()
        cycle.on_response()


def open_raw(http: HttpToolsProtocol, lost: Lost, scope: Any) -> RawOut | None:
    """A writer for the response to the request of ``scope``, if it is the connection's
    current one and its response has not begun; None otherwise (then answer through
    ``send``)."""
    cycle = http.cycle
    if cycle is None or cycle.scope is not scope or cycle.response_started or cycle.disconnected:
        return None
    return RawOut(http, cycle, lost)
