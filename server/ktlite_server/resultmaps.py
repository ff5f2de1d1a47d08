"""The pod server's mappings of its ranks' kept result files, kept between results.

A rank writes a large result into a file it keeps (``resultfiles``); the pod server maps the
file to send it. Mapped afresh for each result, 100 MB cost the server about 12 ms of CPU in
page faults and unmapping, a third of its work on the result. So the server keeps its
mapping of a kept file, keyed by the file's inode, and sends the next result written into
the same file from the same mapping, whose pages are mapped already.

Its mapping holds the file open, so the rank's own test that nothing maps a file (a write
lease) would never pass: the server says so itself, by name. When it takes a kept file it
renames it ``ktlite-sent-*``; once no view of its mapping is left (nothing it sends, keeps for
a re-attach, or relays holds one: checked before each call goes to a rank,
:meth:`ResultMaps.release`) it renames it ``ktlite-idle-*``, which the rank may write again
(renaming it back to a fresh ``ktlite-res-*`` name first). A file the rank removed (its
bound, its exit, its idle time) is dropped here once nothing views it: when a new file is
mapped, when a rank is gone, and every ``keepbudget.IDLE_S / 2`` while any mapping is kept
(the pages of a removed file stay until its last mapping goes).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import stat
import sys
from typing import Any

from ktlite_wire import keepbudget, shm
from ktlite_wire.errors import ProtocolError
from ktlite_wire.perprocess import PerProcess

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | os.O_CLOEXEC


class _Kept:
    __slots__ = ("fd", "mapping", "name", "sent")

    def __init__(self, fd: int, mapping: Any, name: str) -> None:
        self.fd = fd  # our own: fstat says when the rank removed the file
        self.mapping = mapping
        self.name = name
        self.sent = True


def _refs(kept: _Kept) -> int:
    return sys.getrefcount(kept.mapping)


class ResultMaps:
    """The server's mappings of kept result files, by (device, inode)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], _Kept] = {}
        self._sent: list[_Kept] = []  # the kept ones marked sent, for release()
        self._timer: asyncio.TimerHandle | None = None  # the next sweep, while any is kept
        self.reused = 0  # results sent from a mapping kept (tests, benchmarks)

    def __repr__(self) -> str:
        return f"ResultMaps(kept={len(self._kept)}, reused={self.reused})"

    def take(self, path: str, size: int, kind: type[Any]) -> memoryview:
        """A shared read-only view of ``size`` bytes of the kept result file ``path``: of the
        mapping kept for its inode, else of a new one of ``kind``, kept. The file is renamed
        ``ktlite-sent-*`` (its name in the rank's message names nothing any more)."""
        fd = os.open(shm.check(path, shm.RESULT_PREFIX), _OPEN_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ProtocolError(f"{path!r} is not a regular file of this user's; refused")
            sent = shm.renamed(path, shm.SENT_PREFIX)
            key = (st.st_dev, st.st_ino)
            kept = self._kept.get(key)
            reusable = kept is not None and len(kept.mapping) >= size and _refs(kept) == _UNUSED
            if kept is not None and reusable and _moved(path, sent):
                kept.name, kept.sent = sent, True
                self._sent.append(kept)
                self.reused += 1
                return memoryview(kept.mapping)[:size]
            if kept is not None:  # another length, or still viewed: a mapping of its own
                self._kept.pop(key)
                if kept.sent:
                    self._sent.remove(kept)
                _close(kept)
            mapping = kind(fd, max(size, st.st_size), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            if not _moved(path, sent):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                return memoryview(mapping)[:size]
            self.sweep()  # a new file: the rank may have removed an older one for it
            self._kept[key] = kept = _Kept(os.dup(fd), mapping, sent)
            self._sent.append(kept)
            self._arm()
            return memoryview(mapping)[:size]
        finally:
            os.close(fd)

    def release(self) -> None:
        """Mark the files no view of the server's mappings holds any more ``ktlite-idle-*``:
        their rank may write them again. (Runs before every call to a rank: it looks only at
        the files still marked sent, and makes no syscall for a file still viewed.)"""
        if not self._sent:
            return
        for kept in self._sent:
            if _refs(kept) != _UNUSED:
                continue
            idle = shm.renamed(kept.name, shm.IDLE_PREFIX)
            if _moved(kept.name, idle):
                kept.name = idle
            kept.sent = False  # (not moved: its rank removed it; swept later)
        self._sent = [k for k in self._sent if k.sent]

    def sweep(self) -> None:
        """Drop the mappings of files their rank removed (its bound, its exit, its death),
        once nothing views them: when a new file is mapped, and when a rank is gone."""
        self.release()
        for key, kept in list(self._kept.items()):
            if _refs(kept) != _UNUSED:
                continue
            try:
                gone = os.fstat(kept.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                del self._kept[key]
                _close(kept)

    def _arm(self) -> None:
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (tests): swept when a file is mapped, a rank goes
            return
        self._timer = loop.call_later(keepbudget.IDLE_S / 2, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.sweep()
        if self._kept:
            self._arm()

    def clear(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for kept in self._kept.values():
            _close(kept)
        self._kept.clear()
        self._sent.clear()


def _moved(old: str, new: str) -> bool:
    try:
        os.rename(old, new)
    except OSError:
        return False
    return True


def _close(kept: _Kept) -> None:
    with contextlib.suppress(OSError):
        os.close(kept.fd)
    with contextlib.suppress(BufferError):
        kept.mapping.close()  # refused while a view is alive: it goes with its last view


_UNUSED = _refs(_Kept(-1, object(), ""))

_server = PerProcess(ResultMaps)


def server() -> ResultMaps:
    """This pod server's mappings (its event loop's alone: no lock)."""
    return _server.get()
