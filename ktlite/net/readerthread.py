"""The one thread that reads the answers of a caller's calls in flight: the shape
:class:`~ktlite.net.callmux.CallMux` (HTTP answers) and :class:`~ktlite.net.podlinks.LinkMux`
(answers over links to pods) share.

It starts with the first call (an ``epoll`` and a daemon thread) and then turns forever:
:meth:`ReaderThread._turn` waits for what came, reads it and fails silent calls; a bug in a
turn fails every call the reader holds (:meth:`ReaderThread._fail_all`) rather than leave them
waiting, and the reader goes on.

A forked child has no reader (threads do not survive a fork) and shares its parent's
``epoll`` and sockets: there the reader forgets them (:meth:`ReaderThread._forget_all`, the
child's copies closed, the parent's untouched) and the child's next call starts its own.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import threading
import weakref
from typing import Any

logger = logging.getLogger(__name__)

_turn_local = threading.local()  # on a reader's thread: what runs once its turn is over


def after_turn(fn: Any, *args: Any) -> None:
    """``fn(*args)`` once the turn of the reader whose thread this is has ended (its writes
    made: the calls this turn started have left); at once on any other thread. What ends a
    call's future goes here: the thread that waits on it wakes while the reader waits for
    the next answers, not while it still sends the next calls (two threads of one process
    taking the GIL from each other)."""
    later = getattr(_turn_local, "later", None)
    if later is None:
        fn(*args)
    else:
        later.append((fn, args))


class ReaderThread:
    """An ``epoll`` read by one daemon thread, started on first use."""

    thread_name = "ktlite-reader"
    what = "calls in flight"  # in the log line of a failed turn

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._epoll: Any = None
        self._thread: threading.Thread | None = None

    def _forget_all(self) -> None:
        """In a forked child: drop what the parent had in flight (close this process's copies
        of its sockets only). The reader itself is reset after this."""

    def _running(self) -> Any:
        """The epoll, the thread that reads it started (once)."""
        with self._lock:
            if self._thread is None:
                self._epoll = select.epoll()
                self._thread = threading.Thread(
                    target=self._loop, name=self.thread_name, daemon=True
                )
                self._thread.start()
            return self._epoll

    def _on_reader(self) -> bool:
        """Whether this runs on the reader's thread (where nothing may block)."""
        return threading.current_thread() is self._thread

    def _loop(self) -> None:
        later: list[tuple[Any, tuple[Any, ...]]] = []
        _turn_local.later = later
        while True:
            try:
                self._turn()
            except Exception as e:  # noqa: BLE001 - a bug here must not leave calls waiting
                logger.exception("the reader of %s failed; failing those calls", self.what)
                self._fail_all(e)
            while later:
                due = later[:]
                del later[:]
                for fn, args in due:
                    try:
                        fn(*args)
                    except BaseException:  # noqa: BLE001 - never the reader's thread
                        logger.exception("ending a call's future failed")

    def _turn(self) -> None:
        raise NotImplementedError

    def _fail_all(self, error: Exception) -> None:
        """Fail every call the reader holds: a turn raised ``error``."""
        raise NotImplementedError


def _forked(reader: weakref.ref[ReaderThread]) -> None:
    _turn_local.later = None  # forked from a reader's thread: this one reads nothing
    live = reader()
    if live is None:
        return
    live._forget_all()
    old = live._epoll
    live._reset()  # no reader in this process yet; a lock no thread holds
    if old is not None:
        old.close()  # the child's copy: the parent's epoll keeps its registrations
