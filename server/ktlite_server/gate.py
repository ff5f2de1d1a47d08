"""The pod's admission of calls: at most the deployment's concurrency at once, in order."""

from __future__ import annotations

import asyncio
import collections
import contextlib


class Gate:
    """Admits at most ``limit`` calls at once, the others in arrival order (FIFO). A deploy
    closes it, waits for the running calls to end, and reopens it with the new limit."""

    def __init__(self, limit: int = 1) -> None:
        self.limit = limit
        self.active = 0
        self._closed = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._idle: asyncio.Event | None = None

    def try_acquire(self) -> bool:
        """Admit a call now if :meth:`acquire` would without waiting."""
        if not self._closed and self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # admitted just as the waiter went away: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(future)
            raise

    def release(self) -> None:
        self.active -= 1
        if self.active == 0 and self._idle is not None:
            self._idle.set()
        self._wake()

    def _wake(self) -> None:
        while not self._closed and self.active < self.limit and self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                self.active += 1
                future.set_result(None)

    async def close(self) -> None:
        """Admit nothing new and wait until no call runs."""
        self._closed = True
        while self.active:
            self._idle = asyncio.Event()
            await self._idle.wait()
        self._idle = None

    def open(self, limit: int) -> None:
        self.limit, self._closed = max(1, limit), False
        self._wake()
