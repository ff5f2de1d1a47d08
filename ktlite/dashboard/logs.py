"""Live pod logs for the dashboard: one thread per watched deployment follows the backend's
log reading (``Backend.logs(follow=True)``, what ``ktlite logs -f`` reads) into a bounded
buffer of numbered lines; the page asks for the lines after the last one it has, so each
refresh moves only the new lines. A rank's line (``[rank R] ...`` in its pod's log) carries
its rank, so the page filters by rank and searches without asking again.

A follower nobody has read for ``IDLE_S`` stops at its next line; one stops by itself when
its deployment is torn down (the backend's follow ends). One that ended is answered with for
``RETRY_S`` (with why it ended), then a new one reads the logs again.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

KEEP_LINES = 5000  # the newest lines each follower keeps
TAIL_LINES = 1000  # the lines of the existing log read first
ANSWER_LINES = 2000  # the most lines one answer carries
IDLE_S = 120.0
RETRY_S = 10.0  # a follower that ended (its deployment gone, its log unreadable) is kept this long
MAX_FOLLOWERS = 16
_LINE = re.compile(r"^\[(?P<pod>[^\]]*)\] (?:\[rank (?P<rank>\d+)\] )?(?P<text>.*)$", re.S)


def parse(line: str) -> tuple[str | None, int | None, str]:
    """(pod, rank, text) of a backend's log line (``[POD] [rank R] text``; rank None for the
    pod server's own lines, pod None for a line without the pod's prefix)."""
    m = _LINE.match(line)
    if m is None:
        return None, None, line
    rank = m.group("rank")
    return m.group("pod"), None if rank is None else int(rank), m.group("text")


class Follower:
    """Follows one deployment's logs in a thread (see the module's docstring)."""

    def __init__(
        self,
        open_lines: Callable[[], Iterator[str]],
        redact: Callable[[], tuple[str, ...]],
        serial: int = 0,
    ) -> None:
        self.serial = serial  # a new follower numbers its lines from 1 again: the page starts over
        self._open = open_lines
        self._secrets = redact  # asked once, in the follower's thread
        self._redact: tuple[str, ...] = ()
        self._lines: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_LINES)
        self._next = 1
        self._lock = threading.Lock()
        self.read_at = time.monotonic()
        self.error: str | None = None
        self.ended = False
        self.ended_at = float("inf")  # monotonic
        self._thread = threading.Thread(target=self._follow, daemon=True, name="ktlite-logs")
        self._thread.start()

    def _follow(self) -> None:
        lines: Iterator[str] = iter(())
        try:
            self._redact = tuple(s for s in self._secrets() if s)
            lines = self._open()
            for line in lines:
                for secret in self._redact:
                    line = line.replace(secret, "[redacted]")
                pod, rank, text = parse(line)
                with self._lock:
                    self._lines.append({"n": self._next, "pod": pod, "rank": rank, "text": text})
                    self._next += 1
                if time.monotonic() - self.read_at > IDLE_S:
                    break  # nobody watches any more
        except Exception as e:  # noqa: BLE001 - shown on the page, which keeps the lines it has
            logger.info("following logs stopped: %r", e)
            self.error = f"{type(e).__name__}: {e}"
        finally:
            close = getattr(lines, "close", None)
            if close is not None:
                close()
            self.ended_at = time.monotonic()
            self.ended = True

    def since(self, after: int) -> dict[str, Any]:
        """The lines numbered after ``after`` (at most ``ANSWER_LINES``, the newest)."""
        self.read_at = time.monotonic()
        with self._lock:
            first = self._next - len(self._lines)  # the lines are numbered without gaps
            start = max(len(self._lines) - ANSWER_LINES, after - first + 1, 0)
            lines = list(itertools.islice(self._lines, start, None))
        return {"follower": self.serial, "lines": lines, "ended": self.ended, "error": self.error}


class Followers:
    """At most ``MAX_FOLLOWERS`` followers, one per deployment, made when first asked for."""

    def __init__(self) -> None:
        self._by: dict[tuple[str, str], Follower] = {}
        self._lock = threading.Lock()
        self._made = 0

    def get(
        self,
        key: tuple[str, str],
        open_lines: Callable[[], Iterator[str]],
        redact: Callable[[], tuple[str, ...]],
    ) -> Follower:
        with self._lock:
            now = time.monotonic()
            follower = self._by.get(key)
            if follower is not None and now - follower.ended_at < RETRY_S:
                return follower  # still following, or ended a moment ago: the page shows why
            for old in [k for k, f in self._by.items() if now - f.ended_at >= RETRY_S]:
                del self._by[old]
            if len(self._by) >= MAX_FOLLOWERS:
                oldest = min(self._by, key=lambda k: self._by[k].read_at)
                self._by.pop(oldest).read_at = float("-inf")  # it stops at its next line
            self._made += 1
            follower = self._by[key] = Follower(open_lines, redact, self._made)
            return follower
