"""A rank's mappings of its calls' argument files, and whether it let go of them.

The arrays a rank decodes from a large argument are views of its copy-on-write mapping of
the call's shared-memory file: pages it has not written are the file's own. The pod server
(or a caller on the same host) writes its next argument into the same file only once every
rank it went to let go of its mapping (``ktlite_wire.argfiles``), which the rank says in its
``Result`` (``released``). It lets go when the mapping closes: no array, tensor or view of it
is alive (``mmap.close`` refuses while any buffer export remains). A process forked while the
mapping existed (a data loader's workers) has a mapping of the file of its own that this
process cannot see go: such a mapping is never reported as let go.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

from ktlite_wire import shm

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | os.O_CLOEXEC


class ArgMap:
    """One call's mapping of its argument file (``view`` covers ``size`` bytes)."""

    __slots__ = ("mem", "view", "forked", "__weakref__")

    def __init__(self, mem: mmap.mmap | None, view: memoryview) -> None:
        self.mem = mem
        self.view = view
        self.forked = False


# the mappings open now: a fork marks them (weakly held: one a call never let go of, cut short
# by an interrupt, is unmapped once its views go)
_live: weakref.WeakSet[ArgMap] = weakref.WeakSet()
_lock = threading.Lock()


def _after_fork_in_parent() -> None:
    with _lock:
        for m in _live:
            m.forked = True


os.register_at_fork(after_in_parent=_after_fork_in_parent)


def open_map(path: str, size: int) -> ArgMap:
    """Map the first ``size`` bytes of the argument file at ``path`` copy-on-write (a link
    is refused, never followed: ``shm.map_private``)."""
    if size == 0:
        return ArgMap(None, memoryview(bytearray()))
    shm.check(path, shm.ARG_PREFIX)
    fd = os.open(path, _OPEN_FLAGS)
    try:
        mem = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    m = ArgMap(mem, memoryview(mem))
    with _lock:
        _live.add(m)
    return m


def let_go(m: ArgMap) -> bool:
    """Close ``m`` if nothing holds a view of it any more; True when it is closed and no
    process was forked while it was mapped (then nothing of this rank's maps the file).
    A mapping still in use stays; it is unmapped when its last view goes."""
    with _lock:
        _live.discard(m)
    if m.mem is None:
        return True
    try:
        m.view.release()
        m.mem.close()
    except BufferError:  # an array, tensor or view of it is alive
        return False
    return not m.forked
