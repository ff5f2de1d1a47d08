"""Warm shared-memory files for large call arguments: the file a call's arguments land in,
kept for the next call of about its size once nothing maps it any more.

A large argument travels to the ranks through a file in ``/dev/shm`` (``ktlite_wire.shm``):
on the pod server, which receives the body into it; on a caller that shares the pods' host,
which writes the arguments into it. Fresh tmpfs pages cost more than the copy into them (100
MB: about 40 ms of CPU for the pages, 15 more to free them, against 15 for the copy here), so
an :class:`ArgFiles` keeps the files it hands out, within its budget (``keepbudget``: on a
pod, shared with its ranks' result files), and hands one that is free to the next argument of
about its size: its pages are already there. A free file unused for ``keepbudget.IDLE_S`` is
removed.

A rank maps the file copy-on-write, and the arrays it decodes are views of the file's pages
until written: writing the file again while a rank still maps it would change a value the
rank holds. So a file comes back reusable only when every rank it went to said it let go of
its mapping (``rankchannel.Result.released``: no array, tensor or view of it alive, and no
process forked while it was mapped); a file any rank may still map is removed instead (its
pages stay with the mapping until that goes), and never written again. A free file is named
``ktlite-free-arg-*`` while it waits (nothing maps it, no rank may open it by that name) and
gets its ``ktlite-arg-*`` name back when it is handed out; the free ones are removed when the
process that made them exits (a forked child keeps files of its own: ``perprocess``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ktlite_wire import keepbudget, shm
from ktlite_wire.perprocess import PerProcess

FREE_PREFIX = "ktlite-free-arg-"  # a free file's name: no rank opens it (shm.check)


@dataclass(eq=False)
class ArgFile:
    """An open shared-memory file of ``length`` bytes (at least the argument's ``size``),
    written from its start."""

    fd: int
    path: str
    length: int
    warm: bool = False  # its pages were there before this argument (tests, benchmarks)
    kept: bool = False  # counted in the budget: kept for the next argument once free
    used: float = 0.0  # when it was last given back (time.monotonic)


class ArgFiles:
    """Argument files, kept within ``budget`` for reuse once free."""

    def __init__(
        self,
        budget: keepbudget.Budget,
        remove: Callable[[str], None] = shm.remove_later,
        idle_s: float = keepbudget.IDLE_S,
    ) -> None:
        self.budget = budget
        self.remove = remove  # a file's removal: freeing its pages off the caller's thread
        self.idle_s = idle_s
        self._free: list[ArgFile] = []  # least recently given back first
        self._lock = threading.Lock()
        self._expiry = keepbudget.Expiry(self, ArgFiles.expire, idle_s / 2)
        self.reused = 0  # how many arguments landed in a warm file (tests, benchmarks)

    def __repr__(self) -> str:
        return f"ArgFiles(budget={self.budget!r}, free={self.free_bytes()}, reused={self.reused})"

    def free_bytes(self) -> int:
        return sum(f.length for f in self._free)

    def take(self, size: int) -> ArgFile:
        """A file for an argument of ``size`` bytes: a free warm one of about that size (a
        much larger one would hold memory it does not use), else a fresh one, kept where the
        budget has room (the least recently used free files go to make it). The caller
        writes it from its start and gives it back (:meth:`give_back`)."""
        with self._lock:
            free = self._free
            for i in range(len(free) - 1, -1, -1):  # the most recently used first
                f = free[i]
                if size <= f.length <= size + size // 4:
                    del free[i]
                    try:
                        os.rename(_free_name(f.path), f.path)
                    except OSError:  # removed under us (a cleaner of /dev/shm): a fresh one
                        self._discard(f, _free_name(f.path))
                        break
                    self.reused += 1
                    f.warm = True
                    return f
            kept = self._room(size)
        fd, path = shm.create(shm.ARG_PREFIX, size)  # OSError: the caller reports it
        if kept:
            self._expiry.arm()
        return ArgFile(fd, path, size, kept=kept)

    def _room(self, size: int) -> bool:
        """Count ``size`` more bytes in the budget, the least recently used free files
        removed until it has room; False where it has none (or never will)."""
        if size > self.budget.limit:
            return False
        free = self._free
        while not self.budget.reserve(size):
            if not free:
                return False
            gone = free.pop(0)
            self._discard(gone, _free_name(gone.path))
        return True

    def give_back(self, f: ArgFile, reusable: bool) -> None:
        """The call that used ``f`` ended. ``reusable``: nothing maps it any more (every rank
        it went to let go of it, and this process holds no view of it), so a kept one waits
        for the next argument; otherwise it is removed."""
        if reusable and f.kept and shm.rename_taken(f.path, _free_name(f.path)):
            f.used = time.monotonic()
            with self._lock:
                self._free.append(f)
            return
        self._discard(f, f.path)

    def expire(self, now: float | None = None) -> bool:
        """Remove the free files unused for ``idle_s``; whether any is left kept."""
        deadline = (time.monotonic() if now is None else now) - self.idle_s
        with self._lock:
            free = self._free
            while free and free[0].used <= deadline:
                gone = free.pop(0)
                self._discard(gone, _free_name(gone.path))
            return bool(free)

    def _discard(self, f: ArgFile, name: str) -> None:
        """Close ``f`` and remove it (by ``name``); whoever still maps it keeps its pages
        until it lets go."""
        with contextlib.suppress(OSError):
            os.close(f.fd)
        self.remove(name)
        if f.kept:
            f.kept = False
            self.budget.give(f.length)

    def clear(self) -> None:
        """Remove every free file now (at exit: not on a thread)."""
        with self._lock:
            free, self._free = self._free, []
        for f in free:
            with contextlib.suppress(OSError):
                os.close(f.fd)
            with contextlib.suppress(OSError):
                os.unlink(_free_name(f.path))
            self.budget.give(f.length)


def _free_name(path: str) -> str:
    """The name a free file waits under: ``ktlite-free-arg-*`` beside ``ktlite-arg-*``."""
    directory, name = os.path.split(path)
    return os.path.join(directory, FREE_PREFIX + name.removeprefix(shm.ARG_PREFIX))


_files = PerProcess(lambda: ArgFiles(keepbudget.process()), ArgFiles.clear)


def process() -> ArgFiles:
    """This process's argument files, within its budget (``keepbudget.process``: on a pod,
    the pod's); the free ones are removed when the process exits."""
    return _files.get()
