"""Memory a large received payload lands in, and stays in: the arrays decoded from it are
views of it (``FrameParser.room``).

Fresh memory costs more than the copy into it on a small VM: the kernel faults and zeroes
each 4 KiB page as the first byte lands in it (100 MB: 40-60 ms of CPU here, against 10-15 ms
for the copy itself). So a :class:`Landings` keeps the mappings it handed out, up to ``keep``
bytes, and hands one whose payload nobody holds any more (no array, no view of it is alive)
to the next payload of about its size: its pages are already there. The caller's client
keeps one (:func:`caller`, ``KTLITE_RECEIVE_KEEP_MB``, default 256, 0 turns it off); a mapping
still in use is never handed out again, and one past the bound is left to be unmapped when
its payload goes.

Not transparent huge pages: advised for them (``MADV_HUGEPAGE``), 100 MB took 7 ms of CPU
instead of 40 once the kernel had free 2 MiB blocks, but 200-250 ms when it had to compact
memory to make them (a process's first large receive, or one whose earlier payloads are
still held, on a machine whose memory is fragmented by its page cache): more than the faults
they save.
"""

from __future__ import annotations

import mmap
import sys
import threading
from typing import Any

from ktlite_wire import keepbudget
from ktlite_wire.perprocess import PerProcess


def fresh(length: int) -> mmap.mmap:
    """An anonymous private mapping of ``length`` bytes: its pages come as bytes land in them
    (a length claimed by a header costs nothing until its bytes arrive)."""
    return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)


def _refs(items: list[Any], i: int) -> int:
    return sys.getrefcount(items[i])


# the count of a mapping only the list holds, taken the same way (interpreters differ)
_UNUSED = _refs([object()], 0)


class Landings:
    """Mappings for payloads, the ones handed out kept up to ``keep`` bytes for reuse."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._held: list[mmap.mmap] = []  # least recently handed out first
        self._lock = threading.Lock()
        self.reused = 0  # how many payloads landed in warm memory (tests, benchmarks)

    def __repr__(self) -> str:
        return f"Landings(keep={self.keep}, held={self.held_bytes()}, reused={self.reused})"

    def held_bytes(self) -> int:
        return sum(len(m) for m in self._held)

    def take(self, length: int) -> memoryview:
        """``length`` bytes to receive into: a warm mapping nobody uses, else a fresh one."""
        if length > self.keep:
            return memoryview(fresh(length))
        with self._lock:
            held = self._held
            for i in range(len(held)):
                size = len(held[i])
                # about this size (a mapping much larger would hold memory it does not use),
                # and no array, view or parser holds it any more
                if length <= size <= length + length // 4 and _refs(held, i) == _UNUSED:
                    mem = held.pop(i)
                    held.append(mem)
                    self.reused += 1
                    return memoryview(mem)[:length]
            mem = fresh(length)
            held.append(mem)
            total = self.held_bytes()
            while total > self.keep:  # the oldest go: unmapped once nothing holds them
                total -= len(held.pop(0))
            return memoryview(mem)[:length]

    def clear(self) -> None:
        with self._lock:
            self._held.clear()


_caller = PerProcess(lambda: Landings(keepbudget.caller_keep()))


def caller() -> Landings:
    """The caller's process-wide landings (``KTLITE_RECEIVE_KEEP_MB``, read once:
    ``keepbudget.caller_keep``; a forked child makes its own)."""
    return _caller.get()
