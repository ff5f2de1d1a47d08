"""The pod server's end of one rank process's control channel (``ktlite_wire.rankchannel``):
an asyncio protocol that hands on each message in the event loop's callback for the bytes
that complete it, and writes without a task.

Through a ``StreamReader`` each answer took two ``readexactly`` (its length, its body) in a
reader task, which then woke the call's own task for that rank: three passes of the event
loop per answer, 64 of them for a call on 64 ranks. Here the answer is decoded and its future
resolved in the one callback that received its bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ktlite_wire import rankchannel
from ktlite_wire.errors import ProtocolError

LEN = rankchannel.LEN


class RankConnection(asyncio.Protocol):
    """One rank's channel: ``on_message`` gets each message, ``on_bad`` a malformed one
    (nothing after it is read: the channel is closed), ``on_lost`` the end of the channel."""

    def __init__(
        self,
        on_message: Callable[[rankchannel.Message], None],
        on_bad: Callable[[ProtocolError], None],
        on_lost: Callable[[], None],
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False  # the rank's end is gone (EOF, an error, or we closed it)
        self._on_message = on_message
        self._on_bad = on_bad
        self._on_lost = on_lost
        self._buf = bytearray()  # the start of a message whose bytes have not all come
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    # ---- reading -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        buf = self._buf
        if buf:
            buf += data
        own = bool(buf)  # the bytes are in ``buf``, which is reused: each message is copied
        view = memoryview(buf if own else data)
        pos, end = 0, len(view)
        try:
            while end - pos >= LEN.size:
                (n,) = LEN.unpack_from(view, pos)
                if n > rankchannel.MAX_MESSAGE:
                    raise ProtocolError(f"a rank channel message claims {n} bytes")
                start = pos + LEN.size
                if end - start < n:
                    break
                pos = start + n
                # a message's fields are views of its bytes: a slice of ``data`` (immutable)
                # as it is, one of ``buf`` copied (no view of it may outlive this call)
                body = bytes(view[start:pos]) if own else view[start:pos]
                self._on_message(rankchannel.decode(body))
        except ProtocolError as e:
            self._bad(e)
            return
        finally:
            if own:
                view.release()  # before ``buf`` is resized
        if own:
            del buf[:pos]
        elif pos < end:
            buf += view[pos:]

    def _bad(self, e: ProtocolError) -> None:
        self.closed = True
        self._buf = bytearray()
        if self.transport is not None:
            self.transport.close()  # connection_lost follows: the rank's end, as at EOF
        self._on_bad(e)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._wake_writer()
        self._on_lost()

    # ---- writing -----------------------------------------------------------------------

    def write(self, frame: list[Any]) -> None:
        """Queue an encoded message (``rankchannel.frame``); :meth:`drain` waits for room."""
        if self.closed or self.transport is None:
            raise ConnectionResetError("the rank process's control channel is closed")
        if len(frame) == 1:
            self.transport.write(frame[0])
        else:
            self.transport.writelines(frame)

    async def drain(self) -> None:
        """Return once the transport's buffer is below its high-water mark."""
        if self.closed:
            raise ConnectionResetError("the rank process's control channel is closed")
        if not self._paused:
            return
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)
        if self.closed:
            raise ConnectionResetError("the rank process's control channel is closed")

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
