"""A dependency-free transfer progress bar on stderr.

Shown when stderr is a terminal and the transfer is at least :data:`MIN_BYTES`; quiet
otherwise (logs, CI, pods). ``KTLITE_PROGRESS=1`` forces it on (a terminal gets a live bar,
anything else a line every 25%), ``KTLITE_PROGRESS=0`` off.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

MIN_BYTES = 4 << 20


class Progress:
    def __init__(self, label: str, total: int, out: TextIO | None = None) -> None:
        self.out = out or sys.stderr
        self.label, self.total, self.done = label, max(total, 0), 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_quarter = 0
        forced = os.environ.get("KTLITE_PROGRESS", "")
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.enabled = forced == "1" or (forced != "0" and self.tty and self.total >= MIN_BYTES)

    def wrap(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.add(len(chunk))
            yield chunk

    def add(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last_draw >= 0.1:
                self._last_draw = now
                self._draw("\r", "")
        elif self.total:
            quarter = min(4, self.done * 4 // self.total)
            if quarter > self._last_quarter:
                self._last_quarter = quarter
                self._draw("", "\n")

    def close(self) -> None:
        if self.enabled:
            self._draw("\r" if self.tty else "", "\n")

    def _draw(self, start: str, end: str) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        rate = self.done / elapsed
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 24)
            text = f"{self.label} [{bar:<24}] {frac * 100:5.1f}% {_size(self.done)}/{_size(self.total)}"
        else:
            text = f"{self.label} {_size(self.done)}"
        self.out.write(f"{start}{text} {_size(rate)}/s{end}")
        self.out.flush()


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
