"""A rank's large-result files, kept for its next result of about their size.

A rank's value over ``shm.INLINE_MAX`` goes to its pod server (or to a caller on the same
host) through a file in ``/dev/shm`` (``resultfeed``). Fresh tmpfs pages cost more than the
copy into them (100 MB here: about 40 ms of CPU to allocate them in the rank, 15 more to free
them in whoever unmaps the file last, against 15 for the copy), so a rank keeps its result
files, within its pod's budget (``ktlite_wire.keepbudget``: all its ranks' result files and
its server's argument files together, ``KTLITE_RECEIVE_KEEP_MB``), and writes its next large
result into one that nothing maps any more: its pages are already there. A file it has not
written for ``keepbudget.IDLE_S`` (and that was taken) is removed.

Who may write a kept file, and when:

1. The rank names a file it keeps ``ktlite-res-w<pid>-*`` (``shm.KEPT_MARK``). Whoever takes
   it maps it and renames it where it would have unlinked it: a caller on the host that maps
   it ``ktlite-took-w<pid>-*`` (``shm.take``); the pod server that sends it
   ``ktlite-sent-w<pid>-*``, then ``ktlite-idle-w<pid>-*`` once nothing it sends or keeps
   views its mapping of it (``resultmaps``: it keeps that mapping for the next result). No
   message names a file by those names: nobody opens it again but this rank.
2. The rank reuses a file only once it is renamed (so the result in it was taken: a result
   not yet taken, or a duplicate request's, still finds its name) and nothing maps it any
   more: an ``idle`` one, on the pod server's word; a ``took`` one while a write lease
   (``F_SETLEASE``) is granted, which is only while no other process has it open or mapped.
   A result the caller still holds in a mapping of the file is never written under it.
3. The rank renames the file to a fresh ``ktlite-res-w<pid>-*`` name before it writes: the
   name in an earlier result's message never names it again.

A file that went (a lost result's, removed by the server) is forgotten, and its bytes leave
the budget. Kept files are removed when the rank exits (``clear``, also when its pod server is
gone), and by the pod server when the rank dies (:func:`remove_left`). Where leases are not
allowed (another OS, ``fs.leases-enable=0``) a file a caller took gets no second use.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
import time

from ktlite_wire import keepbudget, shm
from ktlite_wire.keepledger import Ledger
from ktlite_wire.perprocess import PerProcess

_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC | os.O_NONBLOCK
_SETLEASE = getattr(fcntl, "F_SETLEASE", None)


def kept_prefix(pid: int) -> str:
    """The name prefix of the result files rank process ``pid`` keeps."""
    return f"{shm.RESULT_PREFIX}{shm.KEPT_MARK}{pid}-"


class _Kept:
    __slots__ = ("path", "length", "used")

    def __init__(self, path: str, length: int, used: float) -> None:
        self.path = path  # the name it was last written under
        self.length = length
        self.used = used  # when it was last written (time.monotonic)


class ResultFiles:
    """This rank's kept result files, within ``budget``."""

    def __init__(self, budget: keepbudget.Budget, idle_s: float = keepbudget.IDLE_S) -> None:
        self.budget = budget
        self.idle_s = idle_s
        self._files: list[_Kept] = []  # least recently written first
        self._lock = threading.Lock()
        self._expiry = keepbudget.Expiry(self, ResultFiles.expire, idle_s / 2)
        self.reused = 0  # how many results went into a warm file (tests, benchmarks)

    def __repr__(self) -> str:
        return f"ResultFiles(files={len(self._files)}, reused={self.reused})"

    def create(self, size: int) -> tuple[int, str]:
        """A file of at least ``size`` bytes for a result, open for writing from its start:
        (fd, path). A warm one of about that size (a much larger one would hold memory it
        does not use) that nothing maps any more, else a fresh one, kept where the budget
        has room (this rank's least recently written taken files go to make it). Raises
        OSError (a full ``/dev/shm``) only after dropping the taken ones."""
        with self._lock:
            got = self._warm(size)
            if got is not None:
                return got
            kept = self._room(size)
        if not kept:
            return shm.create(shm.RESULT_PREFIX, size)
        try:
            try:
                fd, path = shm.create(kept_prefix(os.getpid()), size)
            except OSError:  # no room: the taken kept files go first, then once more
                with self._lock:
                    self._drop_taken(float("inf"))
                fd, path = shm.create(kept_prefix(os.getpid()), size)
        except BaseException:
            self.budget.give(size)
            raise
        with self._lock:
            self._files.append(_Kept(path, size, time.monotonic()))
        self._expiry.arm()
        return fd, path

    def _room(self, size: int) -> bool:
        if size > self.budget.limit:
            return False
        if self.budget.reserve(size):
            return True
        # this rank's least recently written taken files go, one at a time, till it fits
        return any(self._drop(f) and self.budget.reserve(size) for f in list(self._files))

    def _warm(self, size: int) -> tuple[int, str] | None:
        files = self._files
        for i in range(len(files) - 1, -1, -1):  # the most recently written first
            f = files[i]
            path, length = f.path, f.length
            if not size <= length <= size + size // 4:
                continue
            state, fd = _state(path)
            if state is None:
                del files[i]  # removed (a lost result), or taken by a process that unlinks
                self.budget.give(length)
                continue
            if fd < 0:
                continue  # not taken yet, or its pod server still sends from it
            name = shm.renamed(path, state)
            fresh = f"{path.rsplit('-', 1)[0]}-{secrets.token_hex(6)}"
            # a caller's mapping of it (took) must be gone; the pod server's (idle) is idle
            if (state == shm.TOOK_PREFIX and not _unmapped(fd)) or not shm.rename_taken(
                name, fresh
            ):
                os.close(fd)
                continue
            f.path, f.used = fresh, time.monotonic()
            files.append(files.pop(i))
            self.reused += 1
            return fd, fresh
        return None

    def _drop(self, f: _Kept) -> bool:
        """Remove ``f`` if it was taken (one in flight is left: its result is not taken
        yet), its bytes out of the budget; whoever maps it keeps its pages till it lets go."""
        if os.path.lexists(f.path):
            return False
        _remove(f.path)
        self._files.remove(f)
        self.budget.give(f.length)
        return True

    def _drop_taken(self, deadline: float) -> None:
        """Remove the taken files last written at ``deadline`` or before."""
        for f in list(self._files):
            if f.used <= deadline:
                self._drop(f)

    def expire(self, now: float | None = None) -> bool:
        """Remove the taken files not written for ``idle_s``; whether any is left kept."""
        with self._lock:
            self._drop_taken((time.monotonic() if now is None else now) - self.idle_s)
            return bool(self._files)

    def clear(self) -> None:
        """Remove every kept file (at exit, when no pod server will take a result any more)."""
        with self._lock:
            files, self._files = self._files, []
        for f in files:
            with contextlib.suppress(OSError):
                os.unlink(f.path)
            _remove(f.path)
            self.budget.give(f.length)


def _state(path: str) -> tuple[str | None, int]:
    """Which name the kept file last written as ``path`` has now (its prefix; None: gone),
    and for a taken one (``took`` or ``idle``) an open fd of it (else -1). The names are
    tried in the order the file goes through them, so one renamed meanwhile is not missed."""
    for prefix in shm.KEPT_PREFIXES:
        name = shm.renamed(path, prefix)
        if prefix in (shm.TOOK_PREFIX, shm.IDLE_PREFIX):
            try:
                return prefix, os.open(name, _OPEN_FLAGS)
            except OSError:
                continue
        if os.path.lexists(name):
            return prefix, -1
    return None, -1


def _remove(path: str) -> None:
    """Remove a taken kept file under whichever name it has (in the order it goes)."""
    for prefix in shm.KEPT_PREFIXES[1:]:
        with contextlib.suppress(OSError):
            os.unlink(shm.renamed(path, prefix))


def _unmapped(fd: int) -> bool:
    """Whether no other process has the file of ``fd`` open or mapped: a write lease is
    granted only then (and released at once)."""
    if _SETLEASE is None:
        return False
    try:
        fcntl.fcntl(fd, _SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _SETLEASE, fcntl.F_UNLCK)
    return True


def remove_left(pid: int) -> None:
    """Remove the taken result files rank process ``pid`` kept, and its bytes from the pod's
    budget (the pod server, once that process is gone: one killed had no chance to)."""
    ledger = keepbudget.process()
    if isinstance(ledger, Ledger):
        ledger.forget(pid)
    mine = kept_prefix(pid).removeprefix(shm.RESULT_PREFIX)
    prefixes = tuple(p + mine for p in shm.KEPT_PREFIXES[1:])
    directory = shm.shm_dir()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(prefixes):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))


_files = PerProcess(lambda: ResultFiles(keepbudget.process()), ResultFiles.clear)


def process() -> ResultFiles:
    """This rank process's result files, within its pod's budget (``keepbudget.process``);
    removed when the process exits."""
    return _files.get()
