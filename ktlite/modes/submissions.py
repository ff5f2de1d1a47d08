"""A deployment's submitted calls (``remote.submit``): queued in order, at most
``mode.parallel_calls()`` in flight, each ending in its :class:`kt.Future`.

A call the mode can start without waiting (``Mode.start_call``: a call to one pod reached
directly) holds no thread while it runs: it leaves from the thread that submits it (or from the
one that read the answer of the call before it) and its answer is read with every other's
(``ktlite.net.callmux``). Any other call runs on a thread of the deployment's own pool, as
every submitted call once did; either way the next queued call leaves when one ends.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from ktlite.errors import CallCancelled, NotDeployedError, RemoteError
from ktlite.modes.callpath import CallOptions, pool
from ktlite.net.readerthread import after_turn


class CancelledBeforeSend(Exception):
    """A running future was cancelled before its call left: it is never sent."""


Call = tuple[Any, list[Any], CallOptions, Any, "dict[str, Any] | None"]
# (method, parts, options, future, per_rank)


class Submissions:
    """The submitted calls of the deployment ``dep`` (a ``CallPath`` with a ``mode``)."""

    def __init__(self, dep: Any) -> None:
        self.dep = dep
        self._waiting: collections.deque[Call] = collections.deque()
        self._futures: set[Any] = set()  # of the calls queued or in flight, until they end
        self._running = 0
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._local = threading.local()  # pumping: this thread runs _pump's loop already
        self.closed = False

    def submit(self, call: Call) -> None:
        """Queue ``call``; it leaves at once when fewer than the mode's parallel calls run."""
        with self._lock:
            if self.closed:
                raise NotDeployedError(
                    f"deployment {self.dep.name!r} was torn down; call .to() again"
                )
            self._futures.add(call[3])
            self._waiting.append(call)
        self._pump()

    def _pump(self) -> None:
        """Send queued calls while there is room for them (a call that ends while its thread
        sends them frees its room for this loop, not for a loop of its own)."""
        if getattr(self._local, "pumping", False):
            return
        self._local.pumping = True
        try:
            limit = self.dep.mode.parallel_calls()
            while True:
                with self._lock:
                    if self.closed or not self._waiting or self._running >= limit:
                        return
                    call = self._waiting.popleft()
                    self._running += 1
                self._begin(call)
        finally:
            self._local.pumping = False

    def _begin(self, call: Call) -> None:
        method, parts, options, future, per_rank = call
        if future.done() or not future.set_running_or_notify_cancel():
            self._ended(future)  # cancelled while queued (or failed by close()): never sent
            return
        future._stop = lambda call_id, why: self.dep.cancel_all(call_id, why, self.dep.endpoints)

        def sending(call_id: str) -> None:
            future.call_id = call_id
            if future.cancel_requested:
                raise CancelledBeforeSend()

        try:
            started = self.dep.mode.start_call(
                parts,
                options,
                sending,
                per_rank,
                lambda values, error: self._settle(future, values, error),
            )
        except BaseException as e:  # noqa: BLE001 - the future carries every failure
            self._settle(future, None, e)
            return
        if not started:
            with self._lock:
                if self._threads is None:
                    self._threads = concurrent.futures.ThreadPoolExecutor(
                        self.dep.mode.parallel_calls(), thread_name_prefix=f"ktlite-{self.dep.name}"
                    )
                threads = self._threads
            threads.submit(self._run, method, parts, options, future, per_rank, sending)

    def _run(
        self,
        method: Any,
        parts: list[Any],
        options: CallOptions,
        future: Any,
        per_rank: dict[str, Any] | None,
        sending: Callable[[str], None],
    ) -> None:
        try:
            if self.closed:
                raise NotDeployedError(
                    f"deployment {self.dep.name!r} was torn down before this submitted call started"
                )
            values = self.dep.call(method, parts, options, on_send=sending, per_rank=per_rank)
        except BaseException as e:  # noqa: BLE001 - the future carries every failure
            self._settle(future, None, e)
        else:
            self._settle(future, values, None)

    def _settle(self, future: Any, values: list[Any] | None, error: BaseException | None) -> None:
        """Send the next queued call, then end ``future`` with its call's outcome (callbacks
        the user added to it run on a thread of ``pool``, never on the thread that reads every
        call's answer)."""
        if future._done_callbacks:
            pool.submit(self._end, future, values, error)
        else:
            self._end(future, values, error)

    def _end(self, future: Any, values: list[Any] | None, error: BaseException | None) -> None:
        self._ended(future)  # the next queued call leaves before this one's waiter wakes
        # on the thread that reads the answers: once the calls it started have left
        after_turn(self._complete, future, values, error)

    def _complete(self, future: Any, values: list[Any] | None, error: BaseException | None) -> None:
        try:
            if error is None:
                assert values is not None
                future.set_result(values[0] if future.single else values)
            elif isinstance(error, CancelledBeforeSend) or (
                future.cancel_requested and isinstance(error, (CallCancelled, RemoteError))
            ):
                future._end_cancelled()
            else:
                future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass  # failed by close() meanwhile

    def _ended(self, future: Any) -> None:
        with self._lock:
            self._running -= 1
            self._futures.discard(future)
        self._pump()

    def close(self) -> None:
        """No more submitted calls: those not started yet fail with NotDeployedError (calls
        in flight end as their pods answer)."""
        with self._lock:
            self.closed = True
            waiting = [f for f in self._futures if not f.running() and not f.done()]
            self._waiting.clear()
            threads, self._threads = self._threads, None
        for future in waiting:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(
                    NotDeployedError(
                        f"deployment {self.dep.name!r} was torn down before this submitted call "
                        "started"
                    )
                )
        if threads is not None:  # what it still holds fails at once (closed): no thread waits
            threads.shutdown(wait=False)
