"""``kt.Future``: the result of a call that is still running or queued.

``remote.submit(x)`` returns one at once. It is a :class:`concurrent.futures.Future`, so
``concurrent.futures.wait`` / ``as_completed`` take it, and it is awaitable in a running event
loop (``await remote.submit(x)`` in a notebook). ``cancel()`` works on a queued call (it never
starts) and on a running one (its ranks are stopped on every pod; the future ends cancelled).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from concurrent.futures._base import CANCELLED_AND_NOTIFIED, RUNNING
from typing import Any


class Future(concurrent.futures.Future):  # type: ignore[type-arg]
    """A call of a deployment; ``result(timeout=)`` gives what the call returns."""

    def __init__(self, name: str, what: str, single: bool = False) -> None:
        super().__init__()
        self.name = name  # the deployment
        self.what = what  # the function or method called
        self.single = single  # one pod, one rank: the result is its value, not a list
        self.call_id: str | None = None  # known once the call was sent to the pods
        self._stop: Callable[[str, str], None] | None = None  # stops the running call's ranks

    def __repr__(self) -> str:
        with self._condition:
            state = self._state.lower()
        call = f" call={self.call_id}" if self.call_id else ""
        return f"<kt.Future {self.name}.{self.what}{call} {state}>"

    def __await__(self) -> Any:
        return asyncio.wrap_future(self).__await__()

    def cancel(self) -> bool:
        """Cancel the call: a queued one never starts; a running one is stopped on every
        rank, and the future ends cancelled. False when it had already finished."""
        if super().cancel():
            return True
        with self._condition:
            if self._state != RUNNING:
                return False
            stop, call_id = self._stop, self.call_id
            self._cancel_requested = True
        if stop is not None and call_id is not None:
            stop(call_id, "the caller cancelled the future")
        return True

    # ---- used by the deployment's queue ----------------------------------------------

    def _end_cancelled(self) -> None:
        """The running call stopped because of cancel(): end in the cancelled state."""
        with self._condition:
            self._state = CANCELLED_AND_NOTIFIED
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        self._invoke_callbacks()  # type: ignore[attr-defined]  # concurrent.futures.Future's, not in typeshed

    @property
    def cancel_requested(self) -> bool:
        return getattr(self, "_cancel_requested", False)
