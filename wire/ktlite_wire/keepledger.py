"""The kept bytes of one pod's processes, counted together: a pod's keep budget's ledger.

A pod's server and its rank processes each keep warm shared-memory files (argument files:
``argfiles``; result files: ``ktlite_server.resultfiles``), and on Kubernetes every byte in
``/dev/shm`` counts against the pod's memory. So they keep them within one budget for the
whole pod (``keepbudget``): a small shared file of slots, one per process (its pid and the
bytes it keeps), and a header with the budget. A process takes room (:meth:`Ledger.reserve`)
only while the slots' sum leaves it, under ``flock`` (which the kernel lets go of when a process
holding it dies). The pod server makes the file before its ranks start and names it in their
environment (:data:`LEDGER_ENV`); it forgets a rank's slot when the rank dies
(:meth:`Ledger.forget`: the files it kept are removed then too).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Iterator

from ktlite_wire import shm

LEDGER_ENV = "KTLITE_KEEP_LEDGER"
PREFIX = "ktlite-keep-"
SLOTS = 256  # processes of one pod that keep files at once (a server, its ranks); more keep none
_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
_MAGIC = 0x6B746B656570  # "ktkeep": the header's first word


class Ledger:
    """A pod's shared count of kept bytes (at ``path``), bounded by the budget in its header.
    Word 0: the magic; word 1: the budget; then (pid, bytes) per slot."""

    def __init__(self, path: str) -> None:
        fd = os.open(shm.check(path, PREFIX), _OPEN_FLAGS)
        try:
            st = os.fstat(fd)
            size = (SLOTS + 1) * 16
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
                raise ValueError(f"{path!r} is not a keep ledger of this user's")
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.path = path
        self._words = memoryview(self._map).cast("q")
        if self._words[0] != _MAGIC:
            raise ValueError(f"{path!r} is not a keep ledger")
        self.limit = int(self._words[1])
        self._lock = threading.Lock()  # flock is the open file's: threads of one process share it
        self._at = 0  # this process's slot's word index, where known (0: none)

    def __repr__(self) -> str:
        return f"Ledger(limit={self.limit}, held={self.held()})"

    @classmethod
    def create(cls, limit: int) -> Ledger:
        """A new ledger of ``limit`` bytes in ``/dev/shm``, named for this process (remove it
        with :meth:`remove`; one whose process was killed is removed by the next pod server
        on the host: :func:`remove_stale`)."""
        remove_stale()
        fd, path = shm.create(f"{PREFIX}{os.getpid()}-", (SLOTS + 1) * 16)
        try:
            os.pwrite(fd, _MAGIC.to_bytes(8, "little") + max(0, limit).to_bytes(8, "little"), 0)
        finally:
            os.close(fd)
        return cls(path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[memoryview]:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self._words
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def held(self) -> int:
        """The bytes every process of the pod keeps now."""
        with self._locked() as words:
            return sum(words[3::2])

    def reserve(self, n: int) -> bool:
        """Count ``n`` more bytes as this process's, if the pod's total stays within the
        budget (and a slot is free); False, and nothing counted, otherwise."""
        if n > self.limit:
            return False
        with self._locked() as words:
            if sum(words[3::2]) + n > self.limit:
                return False
            at = self._slot(words)
            if at == 0:
                return False
            words[at + 1] += n
            return True

    def give(self, n: int) -> None:
        """This process keeps ``n`` bytes fewer (its slot is freed at none)."""
        with self._locked() as words:
            at = self._slot(words, claim=False)
            if at == 0:
                return
            words[at + 1] = max(0, words[at + 1] - n)
            if words[at + 1] == 0:
                words[at] = 0
                self._at = 0

    def forget(self, pid: int) -> None:
        """Process ``pid`` is gone (its files were removed): its slot is free."""
        with self._locked() as words:
            for at in range(2, len(words), 2):
                if words[at] == pid:
                    words[at] = words[at + 1] = 0

    def _slot(self, words: memoryview, claim: bool = True) -> int:
        pid = os.getpid()
        at = self._at
        if at and words[at] == pid:
            return at
        free = 0
        for at in range(2, len(words), 2):
            if words[at] == pid:
                self._at = at
                return at
            if not free and words[at] == 0:
                free = at
        if claim and free:
            words[free], words[free + 1] = pid, 0
            self._at = free
            return free
        return 0

    def remove(self) -> None:
        """Remove its file (its pod server, at exit). Its mapping stays with this object, so a
        late count (a thread's, at exit) still has somewhere to go."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def remove_stale() -> None:
    """Remove the ledgers of pod servers that are gone (killed before they could: on one
    host, the local backend's pods share ``/dev/shm``)."""
    directory = shm.shm_dir()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid, dash, _ = name.removeprefix(PREFIX).partition("-")
            if not name.startswith(PREFIX) or not dash or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
                continue  # alive (or a process that took its pid: left)
            except ProcessLookupError:
                pass
            except PermissionError:
                continue  # another user's process
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
