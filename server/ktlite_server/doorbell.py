"""One wake-up for a call to many ranks: a futex word in memory the pod server shares with its
rank processes.

A rank process waits on the word, not on its channel. The pod server writes each rank's
message to its channel (waking nobody), then rings once: the word's generation moves on and
one ``FUTEX_WAKE_BITSET`` wakes the ranks it wrote to (rank ``i`` waits with bit ``i % 32``).
Written to directly, each of 64 ranks woke as its message was written, and on a busy machine
preempted the pod server inside that write: a 64-rank call spent ~7 ms writing its messages on
2 cores (``bench/README.md``, 64 ranks on one pod).

A rank reads the generation, reads its channel without blocking, handles what came, and waits
for the generation it read to move on: a message written after that read rings after it too,
so no wake-up is missed. Linux only (x86_64, aarch64); elsewhere :func:`create` returns None
and the ranks block on their channels as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import time

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_WAIT_BITSET, _WAKE_BITSET = 9, 10  # FUTEX_WAIT_BITSET, FUTEX_WAKE_BITSET (not private)
_ALL = 0x7FFFFFFF  # wake this many: every waiter
_ANY = 0xFFFFFFFF  # every bit (FUTEX_BITSET_MATCH_ANY)
_NR = ctypes.c_long(_SYS_FUTEX or 0)
_WAIT_BITSET_L, _WAKE_BITSET_L, _ALL_L = (
    ctypes.c_long(v) for v in (_WAIT_BITSET, _WAKE_BITSET, _ALL)
)
WAIT_S = 1.0  # a waiting rank looks at its channel at least this often (its EOF needs no ring)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> object | None:
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None


class Doorbell:
    """The shared word (``fd``: a memfd the rank processes inherit and map)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._mem = mmap.mmap(fd, mmap.PAGESIZE)
        self._word = ctypes.c_uint32.from_buffer(self._mem)
        self._addr = ctypes.c_void_p(ctypes.addressof(self._word))
        self._futex = _syscall()
        self.rings = 0  # how many times it rang (a call to many ranks rings once)

    @property
    def address(self) -> int:
        """Where the word is in this process (what a waiter's futex call names)."""
        return int(self._addr.value or 0)

    @staticmethod
    def bit(local_rank: int) -> int:
        return 1 << (local_rank % 32)

    @property
    def generation(self) -> int:
        return int(self._word.value)

    def ring(self, mask: int = _ANY) -> None:
        """Wake the ranks whose bits are in ``mask`` (the pod server's side)."""
        self._word.value = (self._word.value + 1) & 0xFFFFFFFF
        self.rings += 1
        self._futex(  # type: ignore[operator]
            _NR, self._addr, _WAKE_BITSET_L, _ALL_L, None, None, ctypes.c_long(mask & _ANY)
        )

    def wait(self, generation: int, bit: int, timeout: float = WAIT_S) -> None:
        """Return once the generation is not ``generation`` any more, a ring for ``bit``
        came, or ``timeout`` passed (a rank's side; the GIL is released meanwhile)."""
        if self._word.value != generation:
            return
        deadline = time.clock_gettime(time.CLOCK_MONOTONIC) + timeout
        ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        self._futex(  # type: ignore[operator]
            _NR,
            self._addr,
            _WAIT_BITSET_L,
            ctypes.c_long(generation),
            ctypes.byref(ts),
            None,
            ctypes.c_long(bit),
        )


def create() -> Doorbell | None:
    """A new doorbell for this pod server's ranks, or None where futexes are not at hand."""
    if _syscall() is None or not hasattr(os, "memfd_create"):
        return None
    fd = os.memfd_create("ktlite-doorbell", os.MFD_CLOEXEC)
    os.ftruncate(fd, mmap.PAGESIZE)
    return Doorbell(fd)


_shared: list[Doorbell | None] = []


def shared() -> Doorbell | None:
    """This pod server's doorbell (made at its first rank), or None where there is none."""
    if not _shared:
        try:
            _shared.append(create())
        except OSError:
            _shared.append(None)
    return _shared[0]


def attach(fd: int) -> Doorbell | None:
    """The pod server's doorbell in a rank process (``fd`` inherited), or None."""
    try:
        if _syscall() is None:
            return None
        bell = Doorbell(fd)
        bell.fd = -1
        return bell
    finally:
        os.close(fd)  # the mapping stays
