"""How much warm memory ktlite keeps for the next large payload, and for how long.

Fresh memory costs more than the copy into it (``landing``), so the memory large payloads
landed in is kept for the next payload of about their size: the caller's receive memory
(``landing``), argument files (``argfiles``), a rank's result files
(``ktlite_server.resultfiles``). What is kept is bounded by ``KTLITE_RECEIVE_KEEP_MB``:

- in a caller's process: the bytes that process keeps (default 256 MiB);
- on a pod: the bytes all the pod's processes keep together, its server's argument files and
  every rank's result files (:class:`~ktlite_wire.keepledger.Ledger`). A pod keeps its files
  in ``/dev/shm``, which on Kubernetes is memory counted against the pod's limit, so where the
  variable is not set the budget is the smallest of 256 MiB, an eighth of the pod's memory
  limit (its cgroup's) and a quarter of the size of its ``/dev/shm`` (:func:`derive`; the
  Kubernetes manifest sets the variable from the pod's spec the same way).

A kept file nobody used for :data:`IDLE_S` is removed (:class:`Expiry`, which looks every
half of that). A payload that does not fit the budget still travels, through memory of its
own that goes when it is taken.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from ktlite_wire import shm
from ktlite_wire.keepledger import LEDGER_ENV, Ledger
from ktlite_wire.perprocess import PerProcess

logger = logging.getLogger(__name__)
T = TypeVar("T")

KEEP_ENV = "KTLITE_RECEIVE_KEEP_MB"
DEFAULT_KEEP = 256 << 20
MEMORY_SHARE = 8  # a pod keeps at most an eighth of its memory limit
SHM_SHARE = 4  # ... and at most a quarter of its /dev/shm
IDLE_S = 60.0  # a kept file unused this long is removed
_NO_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a number about 2**63


def configured() -> int | None:
    """``KTLITE_RECEIVE_KEEP_MB`` in bytes; None where it is not set."""
    raw = os.environ.get(KEEP_ENV, "").strip()
    if not raw:
        return None
    try:
        keep_mb = float(raw)
    except ValueError:
        raise ValueError(
            f"{KEEP_ENV}={raw!r}: expected a number of megabytes (0 keeps none)"
        ) from None
    return max(0, int(keep_mb * (1 << 20)))


def derive(memory: int | None, shm_size: int | None) -> int:
    """A pod's budget where none is set: 256 MiB, at most an eighth of ``memory`` (its limit)
    and a quarter of ``shm_size`` (its ``/dev/shm``), where they are known."""
    budget = DEFAULT_KEEP
    if memory:
        budget = min(budget, memory // MEMORY_SHARE)
    if shm_size:
        budget = min(budget, shm_size // SHM_SHARE)
    return budget


def memory_limit() -> int | None:
    """This process's cgroup memory limit (v2, else v1); None where there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < _NO_LIMIT:
            return int(raw)
        return None
    return None


def shm_size() -> int | None:
    """The size of the ``/dev/shm`` kept files go to; None where they go to a temp dir."""
    directory = shm.shm_dir()
    if directory != "/dev/shm":
        return None
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize or None


def pod_budget() -> int:
    """The bytes a pod's processes keep together: ``KTLITE_RECEIVE_KEEP_MB``, else
    :func:`derive` from what this process sees (its cgroup, its ``/dev/shm``)."""
    configured_bytes = configured()
    if configured_bytes is not None:
        return configured_bytes
    return derive(memory_limit(), shm_size())


def caller_keep() -> int:
    """The bytes a caller's process keeps: ``KTLITE_RECEIVE_KEEP_MB``, else 256 MiB."""
    configured_bytes = configured()
    return DEFAULT_KEEP if configured_bytes is None else configured_bytes


class Budget(Protocol):
    """Room for kept bytes: taken before a file is kept, given back when it goes."""

    limit: int

    def reserve(self, n: int) -> bool: ...

    def give(self, n: int) -> None: ...

    def held(self) -> int: ...


class OwnBudget:
    """A budget this process keeps alone (a caller's; tests)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OwnBudget(limit={self.limit}, held={self._held})"

    def held(self) -> int:
        return self._held

    def reserve(self, n: int) -> bool:
        with self._lock:
            if self._held + n > self.limit:
                return False
            self._held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._held = max(0, self._held - n)


def _pod_ledger() -> Ledger:
    ledger = Ledger.create(pod_budget())
    os.environ[LEDGER_ENV] = ledger.path  # the ranks it starts count in it
    return ledger


_pod = PerProcess(_pod_ledger, Ledger.remove)


def open_for_pod() -> Ledger:
    """The pod server's ledger (made once, removed at its exit), named in this process's
    environment so that the rank processes it starts keep within the same budget."""
    return _pod.get()


def _joined() -> Budget:
    own = _pod.peek()
    if own is not None:
        return own
    path = os.environ.get(LEDGER_ENV)
    if not path:
        return OwnBudget(caller_keep())
    try:
        return Ledger(path)
    except (OSError, ValueError) as e:  # its pod server is gone: keep nothing
        logger.warning("the pod's keep ledger %s cannot be opened (%r): keeping no files", path, e)
        return OwnBudget(0)


_process = PerProcess(_joined)


def process() -> Budget:
    """This process's budget: its pod's ledger (a pod server, its ranks), else its own."""
    return _process.get()


class Expiry(Generic[T]):
    """A daemon thread that calls ``expire()`` of an object every ``period`` seconds while
    that returns True (something is still kept), started again by :meth:`arm`. The object is
    held weakly: the thread ends when it goes."""

    def __init__(self, owner: T, expire: Callable[[T], bool], period: float) -> None:
        self._owner = weakref.ref(owner)
        self._expire = expire
        self.period = period
        self._lock = threading.Lock()
        self._running = False
        self._pid = 0

    def arm(self) -> None:
        """Make sure the thread runs (after something was kept)."""
        if self._running and self._pid == os.getpid():
            return
        with self._lock:
            if self._running and self._pid == os.getpid():
                return
            self._running, self._pid = True, os.getpid()
        threading.Thread(target=self._loop, name="ktlite-keep-expiry", daemon=True).start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.period)  # a timer: nothing waits on it
            owner = self._owner()
            if owner is None:
                return
            with self._lock:
                if not self._expire(owner):
                    self._running = False
                    return
            del owner
