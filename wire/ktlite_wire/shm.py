"""Shared-memory hand-off of large payloads between processes on one host (stdlib only).

A rank and its pod server always share a host; on the local backend the caller does too.
There a payload larger than :data:`INLINE_MAX` is written once to a file in ``/dev/shm``
and the reader maps it copy-on-write: no socket copies, and arrays decoded from it are
writable. Only files this module created (``ktlite-`` prefix, in :func:`shm_dir`) are
ever opened on a peer's say-so.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from typing import Any

INLINE_MAX = 1 << 20
ARG_PREFIX = "ktlite-arg-"
RESULT_PREFIX = "ktlite-res-"


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


def map_private(path: str, size: int) -> memoryview:
    """Map a file copy-on-write: writable views, no copy until written."""
    if size == 0:
        return memoryview(bytearray())
    with open(path, "rb") as f:
        m = mmap.mmap(
            f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    return memoryview(m)


def take(path: str, size: int) -> memoryview:
    """Map a file handed over to us and unlink it: the mapping keeps the memory alive."""
    try:
        return map_private(path, size)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def check(path: str, prefix: str) -> str:
    """``path`` if it is a regular file this module made with ``prefix``; else ValueError."""
    real = os.path.realpath(path)
    if (
        os.path.dirname(real) != os.path.realpath(shm_dir())
        or not os.path.basename(real).startswith(prefix)
        or not os.path.isfile(real)
    ):
        raise ValueError(f"{path!r} is not a ktlite shared-memory file")
    return real
