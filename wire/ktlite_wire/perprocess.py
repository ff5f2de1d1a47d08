"""One object per process: made at first use, made anew in a forked child, ended at exit.

Several of ktlite's objects belong to the process that made them: the warm argument files
(``argfiles``), a rank's kept result files (``ktlite_server.resultfiles``), the caller's receive
memory (``landing``), a pod's ledger of kept bytes (``keepbudget``). A forked child (a data
loader's worker, a user's ``os.fork``) inherits them, but not as its own: a file its parent
keeps may be written by the parent again, and a lock some other thread of the parent held at
the fork is held for ever in the child. So the child makes its own at its first use, and
leaves the parent's alone, also at its exit: the end (removing the files) runs only in the
process that made the object.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """This process's ``make()``, made once (``get``); ``end(it)`` runs at the exit of the
    process that made it, never in a forked child."""

    def __init__(self, make: Callable[[], T], end: Callable[[T], None] | None = None) -> None:
        self._make = make
        self._end = end
        self._value: T | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._registered = False
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def get(self) -> T:
        value = self._value
        if value is not None:
            return value
        with self._lock:
            if self._value is None:
                self._value = self._make()
                self._pid = os.getpid()
                if self._end is not None and not self._registered:
                    self._registered = True  # once: a forked child's own is ended by this too
                    atexit.register(self._at_exit)
            return self._value

    def peek(self) -> T | None:
        """This process's object, if it made one (none made here)."""
        return self._value

    def _at_exit(self) -> None:
        value = self._value
        if value is not None and self._pid == os.getpid() and self._end is not None:
            self._end(value)

    def _reset(self) -> None:
        self._value = None
        self._pid = 0
        self._lock = threading.Lock()


def _forked(holder: weakref.ref[PerProcess[Any]]) -> None:
    live = holder()
    if live is not None:
        live._reset()
