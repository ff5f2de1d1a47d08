"""The threads that run a rank process's calls when its deployment lets several run at once
(``Compute(concurrency=K)``): up to K of them, fed by the thread that reads the channel.

A thread pool woke one of its threads per call, and with eight calls landing together eight
threads then fought for the GIL: 15-19 futex calls a call in the rank, most of them the GIL
passed from thread to thread, and a pool's ``submit`` (a future, its condition, a work item)
cost the reading thread more instructions than the call itself (``bench/README.md``, "The
rank's side of a call"). Here calls that end quickly run one after another on one thread,
taken from a queue with no wake-up per call, and a call that does not end quickly lets the
next ones start on other threads:

- a call is queued; it wakes a thread of its own only when the last call to end ran longer
  than ``SHORT_S`` (calls that wait on something: each gets a thread at once, as before), or
  when no thread is running calls;
- a queued call that has waited ``STUCK_S`` behind a running one gets a thread of its own:
  the reading thread waits for its next message at most until then (:meth:`Runners.patience`),
  so a call never waits on a long one for more than ``STUCK_S``;
- at most ``limit`` threads run calls at once; a queued call can be taken back before it
  starts (:meth:`Runners.interrupt`: answered as interrupted by the reader).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

SHORT_S = 0.001  # calls that end within this run one after another on one thread
STUCK_S = 0.002  # a queued call waits at most this long behind running ones before it gets a thread


class Runners:
    """Up to ``limit`` threads running calls with ``run(msg)``; ``interrupted`` is raised in a
    thread whose call :meth:`interrupt` stops. Every method but the threads' own loop runs on
    the channel's reading thread."""

    def __init__(
        self, run: Callable[[Any], None], limit: int, interrupted: type[BaseException]
    ) -> None:
        self._run = run
        self.limit = limit
        self._interrupted = interrupted
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[Any, float]] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._waiting = 0  # threads asleep in ``_wake`` and not yet woken
        self._active = 0  # threads running a call or about to take one
        self._running: dict[str, int] = {}  # call id -> the thread running it
        self._stopped: set[int] = set()  # threads sent an interrupt for their current call
        self.last = 0.0  # how long the last call to end ran (seconds)
        self._closing = False

    # ---- the reading thread ------------------------------------------------------------

    def submit(self, msg: Any) -> None:
        """Queue call ``msg``; a thread takes it (see the module docstring)."""
        now = time.monotonic()
        with self._lock:
            self._queue.append((msg, now))
            if self._active == 0 or self.last >= SHORT_S:
                self._add(1)

    def patience(self) -> float | None:
        """How long the reader may wait for its next message before a queued call has waited
        ``STUCK_S`` (None: as long as it likes). A call that waited that long gets a thread."""
        if not self._queue:  # (read without the lock: the common case, and a benign race)
            return None
        with self._lock:
            if not self._queue or self._active >= self.limit:
                return None
            left = self._queue[0][1] + STUCK_S - time.monotonic()
            if left > 0:
                return left
            # a thread for every queued call (the running ones are not quick), but for the
            # threads already woken that have not taken one yet
            self._add(len(self._queue) - (self._active - len(self._running)))
            return None

    def interrupt(self, call_id: str) -> Any | None:
        """Stop call ``call_id``: a queued one is taken back and returned (for the caller to
        answer); a running one gets ``interrupted`` raised in its thread."""
        with self._lock:
            for i, (msg, _) in enumerate(self._queue):
                if msg.id == call_id:
                    del self._queue[i]
                    return msg
            ident = self._running.get(call_id)
            if ident is not None:
                self._stopped.add(ident)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(ident), ctypes.py_object(self._interrupted)
                )
        return None

    def close(self) -> None:
        """Let the threads end once the queued calls have run, and wait for them."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
            threads, self._threads = self._threads, []
        for t in threads:
            t.join()

    def _add(self, n: int) -> None:
        """Wake (or start) up to ``n`` more threads, within ``limit`` (the lock held)."""
        while n > 0 and self._active < self.limit:
            n -= 1
            self._active += 1
            if self._waiting:
                self._waiting -= 1
                self._wake.notify()
            else:
                t = threading.Thread(
                    target=self._loop, name=f"ktlite-call-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()

    # ---- each running thread -----------------------------------------------------------

    def _loop(self) -> None:
        ident = threading.get_ident()
        msg: Any = None
        while True:
            try:
                msg = self._next(ident, msg)
                if msg is None:
                    return
                start = time.monotonic()
                self._run(msg)
                self.last = time.monotonic() - start
            except self._interrupted:
                pass  # it came after its call's reply: nothing left to stop
            except Exception:  # its reply could not be sent: the channel's reader sees why
                logger.exception("call %s: its thread failed outside the call", msg.id)

    def _next(self, ident: int, done: Any) -> Any:
        """The next call for this thread once ``done`` (the call it ran) is over; None: end."""
        with self._lock:
            if done is not None:
                self._running.pop(done.id, None)
                if ident in self._stopped:  # an interrupt that has not fired yet: drop it
                    self._stopped.discard(ident)
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
            while not self._queue:
                if self._closing:
                    return None
                self._active -= 1
                self._waiting += 1
                self._wake.wait()
                if self._closing and not self._queue:
                    return None  # (the counts no longer matter: nothing is queued again)
            msg, _ = self._queue.popleft()
            self._running[msg.id] = ident
            return msg
