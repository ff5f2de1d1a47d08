"""The silence rule of a response being read from another pod: :class:`QuietTimer`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class QuietTimer:
    """Calls ``expired`` once ``timeout`` seconds pass with no :meth:`progress`: one timer,
    re-armed only when it fires early (a ``call_later`` or ``wait_for`` per chunk would cost
    more than the rest of a warm hop). A response's silence rule, over HTTP or a peer link."""

    def __init__(self, timeout: float, expired: Callable[[], None]) -> None:
        self.timeout = timeout
        self._expired = expired
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # made on the loop it serves; asked once: each get_running_loop() is a getpid() call
        # (Python 3.11), and progress() runs for every message a link reads
        self._loop = asyncio.get_running_loop()

    def progress(self) -> None:
        self._last = self._loop.time()  # the one timer checks it when it fires
        if self._timer is None:
            self._timer = self._loop.call_later(self.timeout, self._fire)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        idle = self._loop.time() - self._last
        if idle < self.timeout:
            self._timer = self._loop.call_later(self.timeout - idle, self._fire)
            return
        self._timer = None
        self._expired()
