"""One call's answer on a peer link (``linkclient``), read as an HTTP answer is: ``status``
and ``headers`` once its head came, then its frame stream's bytes (``iter_chunks``); a
``RUN``'s outcomes in ``done``. Fed by the link's protocol (``PeerLink``), which owns it."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ktlite_server.peers import PeerError, PeerTimeout
from ktlite_server.silence import QuietTimer
from ktlite_wire.headers import ERROR_CODE_HEADER

if TYPE_CHECKING:
    from ktlite_server.linkclient import PeerLink


class LinkStream:
    """One stream of a link as the link feeds it (``PeerLink.data_received``): its head, its
    frame stream's bytes, a ``RUN``'s ``DONE``, its end, or its failure."""

    # its silence is watched by the link, for every such stream at once (a RUN's answer:
    # the pod beats for each call it runs), not by a timer of its own
    watched_by_link = False

    def __init__(self, link: PeerLink, stream: int, read_timeout: float) -> None:
        self.link = link
        self.stream = stream
        self._timeout = read_timeout
        self._ended = False  # END came: the stream is complete
        self._closed = False  # this end closed the stream (CLOSE sent)

    def head(self, status: int, code: str, body: bytes) -> None:
        raise NotImplementedError(f"{type(self).__name__}.head")

    def data(self, payload: memoryview) -> None:
        raise NotImplementedError(f"{type(self).__name__}.data")

    def finish(self, done: memoryview) -> None:
        raise NotImplementedError(f"{type(self).__name__}.finish")

    def end(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}.end")

    def fail(self, error: PeerError) -> None:
        raise NotImplementedError(f"{type(self).__name__}.fail")

    def _stop_timer(self) -> None:
        """No timer of its own (a subclass may have one)."""

    def release(self) -> None:
        """The reader is done: a stream still open is closed (the pod abandons its call)."""
        self._stop_timer()
        self._close()
        self.link.forget(self.stream)

    def _close(self) -> None:
        if not self._ended and not self._closed:
            self._closed = True
            self.link.close_stream(self.stream)

    def expire(self) -> None:
        """Silent for its read timeout: it fails, its stream is closed."""
        self.fail(PeerTimeout(f"{self.link.key} sent nothing for {self._timeout:g}s"))
        self._close()


class LinkResponse(LinkStream):
    """One call's answer on a link: ``status`` and ``headers`` once its head came, then its
    frame stream's bytes (``iter_chunks``)."""

    def __init__(self, link: PeerLink, stream: int, read_timeout: float) -> None:
        super().__init__(link, stream, read_timeout)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[memoryview] = deque()
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter: asyncio.Future[None] | None = None
        self.done: memoryview | None = None  # a RUN's DONE: its outcomes (linkframes)
        self._error: PeerError | None = None
        self._quiet = QuietTimer(read_timeout, self.expire)
        self._arm = self._quiet.progress
        self._arm()

    def _stop_timer(self) -> None:
        self._quiet.stop()

    # -- fed by the link ----------------------------------------------------------------

    def head(self, status: int, code: str, body: bytes) -> None:
        self.status = status
        if code:
            self.headers[ERROR_CODE_HEADER] = code
        if body:
            self._chunks.append(memoryview(body))
        if status != 200:
            self.end()
        self._arm()
        if not self._head.done():
            self._head.set_result(None)

    def data(self, payload: memoryview) -> None:
        if not self._head.done():  # a RUN's first frames: the pod has the call
            self.status = 200
            self._head.set_result(None)
        self._chunks.append(payload)
        self._arm()
        self._wake()

    def finish(self, done: memoryview) -> None:
        """A RUN's ``DONE``: its outcomes, and the stream's end."""
        self.done = done
        self.status = 200
        self.end()
        if not self._head.done():
            self._head.set_result(None)

    def end(self) -> None:
        self._ended = True
        self._stop_timer()
        self._wake()

    def fail(self, error: PeerError) -> None:
        if self._ended or self._error is not None:
            return
        self._error = error
        self._stop_timer()
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a caller that stopped waiting leaves no warning
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- read by the coordinator (PeerResponse's surface) --------------------------------

    @property
    def headed(self) -> bool:
        return self._head.done() and self._head.exception() is None

    async def until_head(self) -> None:
        await self._head

    async def iter_chunks(self) -> AsyncIterator[memoryview]:
        while True:
            while self._chunks:
                yield self._chunks.popleft()
            if self._ended:
                return
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        return b"".join([bytes(c) async for c in self.iter_chunks()])
