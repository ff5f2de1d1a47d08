"""What a long wait shows on stderr, dependency-free: a transfer's bar (:class:`Progress`) and
a wait's one status line (:class:`StatusLine`, :func:`ticking`).

A terminal sees one line rewritten in place; anything else (a log, a notebook, CI) plain
lines. ``KTLITE_PROGRESS=0`` turns both off; ``KTLITE_PROGRESS=1`` turns the transfer bar on
outside a terminal too (a line every 25%). A transfer bar needs at least :data:`MIN_BYTES`; a
status line shows only once its wait has lasted :data:`SHOW_AFTER_S`, so quick waits stay
quiet.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

MIN_BYTES = 4 << 20
SHOW_AFTER_S = 1.0  # a wait shorter than this shows nothing
PLAIN_EVERY_S = 10.0  # outside a terminal: an unchanged wait says so again this often
_ERASE = "\x1b[K"  # erase to the end of the line: a shorter redraw leaves nothing behind


def quiet() -> bool:
    return os.environ.get("KTLITE_PROGRESS", "") == "0"


class Progress:
    """A transfer's bar; ``delay_s``: drawn only once the transfer has lasted that long (a
    call's argument: the bar of a fast one would only flicker), unless forced on."""

    def __init__(
        self, label: str, total: int, out: TextIO | None = None, delay_s: float = 0.0
    ) -> None:
        self.out = out or sys.stderr
        self.label, self.total, self.done = label, max(total, 0), 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_quarter = 0
        forced = os.environ.get("KTLITE_PROGRESS", "")
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.enabled = forced == "1" or (forced != "0" and self.tty and self.total >= MIN_BYTES)
        self.delay_s = 0.0 if forced == "1" else delay_s
        self.shown = False

    def wrap(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.add(len(chunk))
            yield chunk

    def add(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay_s:
            return
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
        if self.enabled and (self.shown or not self.delay_s):
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
        self.out.write(f"{start}{text} {_size(rate)}/s{_ERASE if self.tty else ''}{end}")
        self.out.flush()
        self.shown = True


class StatusLine:
    """One line about a long wait (``ktlite: LABEL: TEXT (12 s)``): rewritten in place in a
    terminal; elsewhere a plain line when the text changes, and every
    :data:`PLAIN_EVERY_S` while it does not. Nothing before :data:`SHOW_AFTER_S`; safe to
    update from several threads."""

    def __init__(
        self, label: str, out: TextIO | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.out = out or sys.stderr
        self.label = label
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.enabled = not quiet()
        self.clock = clock
        self.start = clock()
        self.text = ""
        self.shown = False
        self._said = ("", -1e9)  # the last text drawn, and when
        self._lock = threading.Lock()

    def update(self, text: str) -> None:
        with self._lock:
            self.text = text
            self._draw(final=False)

    def tick(self) -> None:
        """Redraw the elapsed time (a terminal) or say the wait again (elsewhere, now and
        then)."""
        with self._lock:
            self._draw(final=False)

    def done(self, text: str | None = None) -> None:
        """The wait is over: a shown line ends with ``text`` (else its last) and the total time."""
        with self._lock:
            if text is not None:
                self.text = text
            if self.shown:
                self._draw(final=True)

    def _draw(self, final: bool) -> None:
        if not self.enabled or not self.text:
            return
        elapsed = self.clock() - self.start
        if elapsed < SHOW_AFTER_S and not self.shown:
            return
        said, at = self._said
        again = 0.2 if self.tty else PLAIN_EVERY_S  # an unchanged text is redrawn this often
        if not final and said == self.text and elapsed - at < again:
            return
        self._said = (self.text, elapsed)
        line = f"ktlite: {self.label}: {self.text} ({elapsed:.0f} s)"
        if self.tty:
            self.out.write(f"\r{line}{_ERASE}{chr(10) if final else ''}")
        else:
            self.out.write(line + "\n")
        self.out.flush()
        self.shown = True


@contextlib.contextmanager
def ticking(label: str, text: str, out: TextIO | None = None) -> Iterator[StatusLine]:
    """A :class:`StatusLine` for a wait with no steps of its own (a blocking call): a thread
    redraws its elapsed time every second until the block ends."""
    line = StatusLine(label, out)
    line.update(text)
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(1.0):
            line.tick()

    thread = threading.Thread(target=run, name="ktlite-status-line", daemon=True)
    if line.enabled:
        thread.start()
    try:
        yield line
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=2.0)
        line.done()


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
