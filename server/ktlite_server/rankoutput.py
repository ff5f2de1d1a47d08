"""A rank process's stdout and stderr: read from pipes as the rank writes them (so the output
of C extensions and subprocesses is caught too), cut into lines for the pod's log and the
calls' streams, and drained before a call's result is handed on, so a call's last lines always
come before its result.

The event loop reads a pipe when it has bytes, but its wake-up for a pipe can come after the
one for the result the rank wrote later (the kernel may report the two in either of two passes),
so a result is handed on only after asking the kernel which pipes still hold bytes (a ``poll``).
Every rank pipe of this pod server is in one poll set (:class:`Pipes`), and one poll serves
every result read before it: a result is drained for only if no drain ran since its bytes
were read (:meth:`Pipes.drain_after`). A call to 64 ranks asked 64 polls, one per answer; now
one per batch of answers the loop read together.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import select
from collections.abc import Callable

LineSink = Callable[[str, str], None]  # (stream "out" or "err", a line without its newline)


class Pipes:
    """Every rank's pipes of this process in one poll set; ``drains`` counts its drains."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._readers: dict[int, Callable[[int], None]] = {}
        self.drains = 0

    def add(self, fd: int, read: Callable[[int], None]) -> None:
        self._poll.register(fd, select.POLLIN)
        self._readers[fd] = read

    def discard(self, fd: int) -> None:
        if self._readers.pop(fd, None) is not None:
            with contextlib.suppress(KeyError):
                self._poll.unregister(fd)

    def drain(self) -> None:
        """Read every pipe that has bytes now (one system call for all of them)."""
        if self._readers:
            for fd, _ in self._poll.poll(0):
                read = self._readers.get(fd)
                if read is not None:
                    read(fd)
        self.drains += 1

    def drain_after(self, heard: int) -> None:
        """Drain unless a drain ran since ``drains`` was ``heard`` (when a result was read)."""
        if self.drains == heard:
            self.drain()


_pipes: list[Pipes] = []


def pipes() -> Pipes:
    """This process's pipes (one set, as the event loop is one)."""
    if not _pipes:
        _pipes.append(Pipes())
    return _pipes[0]


class RankOutput:
    """One rank's two pipes: each line goes to ``on_line``; stderr's last lines to ``tail``."""

    def __init__(self, on_line: LineSink, tail: collections.deque[str]) -> None:
        self._on_line = on_line
        self._tail = tail
        self._fds: dict[int, str] = {}
        self._partial = {"out": b"", "err": b""}

    def attach(self, loop: asyncio.AbstractEventLoop, stdout: int, stderr: int) -> None:
        for fd, name in ((stdout, "out"), (stderr, "err")):
            os.set_blocking(fd, False)
            self._fds[fd] = name
            pipes().add(fd, self.read)
            loop.add_reader(fd, self.read, fd)

    def read(self, fd: int) -> None:
        """Read pipe ``fd`` until it is empty (at its end: the last partial line too)."""
        stream = self._fds.get(fd)
        if stream is None:
            return
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                asyncio.get_running_loop().remove_reader(fd)
                self._fds.pop(fd, None)
                pipes().discard(fd)
                self._emit(stream, self._partial[stream], final=True)
                self._partial[stream] = b""
                return
            self._emit(stream, self._partial[stream] + data, final=False)

    def _emit(self, stream: str, data: bytes, final: bool) -> None:
        lines = data.split(b"\n")
        self._partial[stream] = b"" if final else lines.pop()
        for raw in lines:
            if final and not raw:
                continue
            text = raw.decode("utf-8", "replace").rstrip("\r")
            if stream == "err":
                self._tail.append(text)
            self._on_line(stream, text)

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        """The rank is gone: read what its pipes still hold, then stop watching them."""
        for fd in list(self._fds):
            self.read(fd)
        for fd in list(self._fds):
            loop.remove_reader(fd)
            pipes().discard(fd)
        self._fds.clear()
