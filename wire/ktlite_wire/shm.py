"""Shared-memory hand-off of large payloads between processes on one host (stdlib only).

A rank and its pod server always share a host; on the local backend the caller does too.
There a payload larger than :data:`INLINE_MAX` is written once to a file in ``/dev/shm``
and the reader maps it copy-on-write: no socket copies, and arrays decoded from it are
writable. Only files this module created are ever opened or removed on a peer's say-so: a
name directly in :func:`shm_dir` (no ``..``, no other directory) with the prefix its kind of
payload has, opened without following a link; any other path is a :class:`ProtocolError`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import mmap
import os
import queue
import stat
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from ktlite_wire.errors import ProtocolError

INLINE_MAX = 1 << 20
ARG_PREFIX = "ktlite-arg-"
RESULT_PREFIX = "ktlite-res-"
# a result file its rank wants back (``ktlite_server.resultfiles``): named RESULT_PREFIX +
# KEPT_MARK + the rank's pid; a caller that takes it renames it TOOK_PREFIX + the rest, the pod
# server SENT_PREFIX (then IDLE_PREFIX once it sends nothing from it: ``resultmaps``)
KEPT_MARK = "w"
TOOK_PREFIX = "ktlite-took-"
SENT_PREFIX = "ktlite-sent-"
IDLE_PREFIX = "ktlite-idle-"
KEPT_PREFIXES = (RESULT_PREFIX, TOOK_PREFIX, SENT_PREFIX, IDLE_PREFIX)  # in the order it goes
_KEPT_START = RESULT_PREFIX + KEPT_MARK
# a FIFO or device planted under a ktlite name must not block the open (mmap then refuses it)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | os.O_CLOEXEC


@functools.cache  # once per process: no syscalls per payload
def shm_dir() -> str:
    return (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else tempfile.gettempdir()
    )


def write(parts: list[Any], prefix: str) -> tuple[str, int]:
    """Write message parts to a fresh shared-memory file; returns (path, size)."""
    fd, path = tempfile.mkstemp(prefix=prefix, dir=shm_dir())
    size = 0
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            for p in parts:
                mv = memoryview(p).cast("B")
                while mv.nbytes:
                    n = f.write(mv)
                    size += n
                    mv = mv[n:]
    except BaseException:
        os.unlink(path)
        raise
    return path, size


def create(prefix: str, size: int) -> tuple[int, str]:
    """A fresh shared-memory file of ``size`` bytes, open for writing: (fd, path). Its length
    is set at once, so a reader may map all of it while it is written (its pages come as
    bytes are written: until then it holds no memory)."""
    fd, path = tempfile.mkstemp(prefix=prefix, dir=shm_dir())
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, path


def write_into(fd: int, parts: list[Any], piece: int, progress: Callable[[int], None]) -> int:
    """Write message parts to ``fd`` from its start, ``progress(total)`` after each ``piece``
    bytes (and at the end); returns the total. An OSError (a full ``/dev/shm``) is raised
    with what was written before it reported."""
    total = reported = 0
    for p in parts:
        mv = memoryview(p).cast("B")
        while mv.nbytes:
            n = os.pwrite(fd, mv[: piece - (total - reported)], total)
            total += n
            mv = mv[n:]
            if total - reported >= piece:
                progress(total)
                reported = total
    if total != reported or total == 0:
        progress(total)
    return total


def map_private(path: str, size: int) -> memoryview:
    """Map a file copy-on-write: writable views, no copy until written. A link at ``path``
    is refused (OSError), never followed."""
    if size == 0:
        return memoryview(bytearray())
    fd = os.open(path, _OPEN_FLAGS)
    try:
        return _map(fd, size)
    finally:
        os.close(fd)


def _map(fd: int, size: int, kind: type[mmap.mmap] | None = None) -> memoryview:
    if size == 0:
        return memoryview(bytearray())
    if kind is not None:  # shared and read-only: it sees the file's pages as they are written
        return memoryview(kind(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    return memoryview(
        mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    )


def take(
    path: str, size: int, prefix: str = RESULT_PREFIX, kind: type[mmap.mmap] | None = None
) -> memoryview:
    """Map a file handed over to us and unlink it: the mapping keeps the memory alive.
    ``path`` must name a file this module made with ``prefix`` (:func:`check`); a path it
    does not name, a link, or anything but a regular file of this user's is not removed.
    ``kind``: a shared read-only mapping of that ``mmap`` class, for a file its writer is
    still writing (a private one is writable, and sees the file as it is when touched).

    A result file its rank keeps (:func:`kept`) is renamed to :func:`took_path` instead: the
    rank writes its next result into it once nothing maps it any more, and removes it."""
    fd = os.open(check(path, prefix), _OPEN_FLAGS)
    try:
        st = os.fstat(fd)  # once per payload over INLINE_MAX: a file of this user's own
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ProtocolError(f"{path!r} is not a regular file of this user's; refused")
        try:
            return _map(fd, size, kind)
        finally:
            if not (kept(path) and rename_taken(path, took_path(path))):
                with contextlib.suppress(OSError):
                    os.unlink(path)
    finally:
        os.close(fd)


def kept(path: str) -> bool:
    """Whether ``path`` names a result file its rank keeps for its next result."""
    name = os.path.basename(path)
    if not name.startswith(_KEPT_START):
        return False
    # ``ktlite-res-w<pid>-*``: a file it does not keep has a random name (``mkstemp``: no "-"
    # in it), which may start with the mark too
    pid, dash, _ = name[len(_KEPT_START) :].partition("-")
    return bool(dash) and pid.isdigit()


def took_path(path: str) -> str:
    """The name a kept result file has once a caller took it (mapped it to read it):
    ``ktlite-took-*`` beside ``ktlite-res-*``. No peer's message names such a file."""
    return renamed(path, TOOK_PREFIX)


def renamed(path: str, prefix: str) -> str:
    """A kept result file's name (any of :data:`KEPT_PREFIXES`) with ``prefix`` instead."""
    directory, name = os.path.split(path)
    for old in KEPT_PREFIXES:
        if name.startswith(old):
            return os.path.join(directory, prefix + name.removeprefix(old))
    raise ValueError(f"{path!r} is not a kept result file's name")


def rename_taken(old: str, new: str) -> bool:
    """Rename ``old`` to ``new``; False where that failed (another process renamed or removed
    it first: whoever renames a kept file owns it)."""
    try:
        os.rename(old, new)
    except OSError:
        return False
    return True


def check(path: str, prefix: str) -> str:
    """``path`` if it names a file directly in :func:`shm_dir` whose name starts with
    ``prefix``; else :class:`ProtocolError` naming it. (The file itself is opened without
    following links: :func:`map_private`.)"""
    directory, name = os.path.split(path)
    if directory != shm_dir() or not name.startswith(prefix) or name in (".", ".."):
        raise ProtocolError(
            f"{path!r} is not a ktlite shared-memory file (one named {prefix}* directly in "
            f"{shm_dir()}); refused: it is neither opened nor removed"
        )
    return path


_doomed: queue.SimpleQueue[str | None] | None = None
_remover: threading.Thread | None = None
_remover_lock = threading.Lock()
REMOVE_AT_EXIT_S = 10.0  # how long an exiting process waits for the files it queued


def remove_later(path: str) -> None:
    """Remove the file at ``path`` on a thread of this process's, not here: freeing a large
    file's pages takes milliseconds (about 1 ms per 8 MB on a small VM) that a call's return,
    or a server's event loop, need not wait for. What is queued is removed before the
    process exits (it waits up to :data:`REMOVE_AT_EXIT_S`)."""
    global _doomed, _remover
    if _doomed is None:
        with _remover_lock:
            if _doomed is None:
                doomed: queue.SimpleQueue[str | None] = queue.SimpleQueue()
                _remover = threading.Thread(
                    target=_remove, args=(doomed,), name="ktlite-shm-remover", daemon=True
                )
                _remover.start()
                atexit.register(_drain, doomed, _remover)
                _doomed = doomed
    _doomed.put(path)


def _remove(doomed: queue.SimpleQueue[str | None]) -> None:
    while (path := doomed.get()) is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _drain(doomed: queue.SimpleQueue[str | None], remover: threading.Thread) -> None:
    doomed.put(None)
    remover.join(REMOVE_AT_EXIT_S)
