"""A large result sent while its rank still writes it: the rank's progress, and the mapping
the pod server sends from.

A rank's value over ``shm.INLINE_MAX`` goes through a shared-memory file. Written whole
before the pod server sends a byte, the two steps add up (100 MB: the rank's write of fresh
tmpfs pages, 35 ms or more, then the stream); so the rank sets the file's length, answers
the call at once (``rankchannel.Result(streaming=True)``), and writes it in pieces of
:data:`PIECE` bytes, saying after each how far it got (``rankchannel.Written``). The pod
server maps the file shared and read-only (a :class:`GrowingMap`, carrying the rank's
:class:`Feed`) and sends each piece once it is written (:func:`ready`), while the rank writes
the next.

A rank that dies, fails to write (a full ``/dev/shm``), or stops writing for :data:`STALL_S`
fails its feed: the writer raises :class:`ResultLost`, which names the rank and how far it
got; the response is cut off mid-frame, so the caller never takes a truncated result for a
whole one.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from ktlite_server import resultmaps
from ktlite_wire import shm

PIECE = 4 << 20  # the rank reports its progress after every this many bytes
STALL_S = 60.0  # a rank that writes nothing of its result for this long has failed it


class ResultLost(RuntimeError):
    """A streaming result could not be read whole: its rank died or failed to write it."""


class Feed:
    """How much of one rank's streaming result is written; awaited by whoever sends it."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.written = 0
        self.error = ""
        self._changed: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"Feed(rank={self.rank}, written={self.written}/{self.size}, error={self.error!r})"

    @property
    def finished(self) -> bool:
        return self.written >= self.size or bool(self.error)

    def advance(self, written: int, error: str = "") -> None:
        """The rank wrote ``written`` bytes (or failed: ``error``)."""
        self.written = max(self.written, min(written, self.size))
        if error and not self.error:
            self.error = error
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def fail(self, error: str) -> None:
        if not self.finished:
            self.advance(self.written, error)

    async def until(self, end: int, stall_s: float = STALL_S) -> None:
        """Return once the first ``end`` bytes are written; raise :class:`ResultLost` when the
        rank failed, or wrote nothing for ``stall_s`` seconds meanwhile."""
        while self.written < end:
            if self.error:
                raise ResultLost(
                    f"rank {self.rank}'s result ({self.size} bytes) was lost after "
                    f"{self.written} bytes: {self.error}"
                )
            if self._changed is None:
                self._changed = asyncio.Event()
            before = self.written
            try:
                await asyncio.wait_for(self._changed.wait(), stall_s)
            except asyncio.TimeoutError:
                if self.written == before and not self.error:
                    self.fail(
                        f"the rank wrote nothing of it for {stall_s:g}s (it is stuck, or "
                        "its process stopped); its call is reported as failed"
                    )


class GrowingMap(mmap.mmap):
    """A shared read-only mapping of a result file its rank is still writing; ``feed`` says
    how far it got (None: written whole)."""

    feed: Feed | None = None


def take(path: str, size: int, feed: Feed | None) -> memoryview:
    """The result file at ``path``, mapped and unlinked (``shm.take``); with ``feed``, shared,
    so that its pages are read as the rank writes them. A file its rank keeps is mapped
    shared, and that mapping kept for the next result written into it (``resultmaps``)."""
    if feed is not None and shm.kept(path):
        view = resultmaps.server().take(path, size, GrowingMap)
        mapping = view.obj
        if isinstance(mapping, GrowingMap):
            mapping.feed = feed
        return view
    if feed is None or feed.finished and not feed.error:
        return shm.take(path, size)
    view = shm.take(path, size, kind=GrowingMap)
    mapping = view.obj
    if isinstance(mapping, GrowingMap):
        mapping.feed = feed
    return view


def feed_of(part: Any) -> Feed | None:
    """The feed of a part that is a view of a :class:`GrowingMap` still being written."""
    if type(part) is not memoryview or not isinstance(part.obj, GrowingMap):
        return None
    feed = part.obj.feed
    if feed is None or (feed.finished and not feed.error):
        return None
    return feed  # still written, or failed (its sender must hear of it)


def growing(parts: Iterable[Any]) -> bool:
    """Whether any part is a result its rank still writes (or failed to)."""
    return any(feed_of(p) is not None for p in parts)


async def written(parts: list[Any]) -> AsyncGenerator[list[Any], None]:
    """``parts`` in runs, each as soon as it is written: a growing part in pieces of
    :data:`PIECE` bytes (the first with the parts before it), each once its rank wrote it.
    A writer sends each run as it comes (one HTTP chunk each: the frame's bytes are the same)."""
    run: list[Any] = []
    for part in parts:
        feed = feed_of(part)
        if feed is None:
            run.append(part)
            continue
        view = memoryview(part).cast("B")
        whole = view.nbytes == feed.size  # a view that does not start the file waits for all
        for i in range(0, view.nbytes, PIECE):
            await feed.until(min(i + PIECE, view.nbytes) if whole else feed.size)
            run.append(view[i : i + PIECE])
            yield run
            run = []
    if run:
        yield run


async def complete(parts: Iterable[Any]) -> None:
    """Return once every part is written whole (a writer that sends a frame at once)."""
    for p in parts:
        feed = feed_of(p)
        if feed is not None:
            await feed.until(feed.size)
