"""Call ids: 32 hex digits, unique to each call of every caller, made without a system call
that lets go of the GIL.

A call's id was 128 random bits from ``os.urandom`` per call. Reading them releases the GIL:
the thread that reads every submitted call's answer and sends the next call (``podlinks``)
then waits for the GIL while the user's thread holds it (up to the interpreter's switch
interval, 5 ms), once per call. An id is now 64 random bits drawn once per process (again in
a forked child) and a 64-bit count of the calls it made: unique within the
process, and across processes as random ids are. A pod keys "a call runs at most once" on it;
nothing treats it as a secret (every request about a call carries the deployment's token).
"""

from __future__ import annotations

import itertools
import os

_prefix = ""
_count = itertools.count()


def _draw() -> None:
    """This process's random half of its ids (a forked child draws its own at once)."""
    global _prefix, _count
    _prefix, _count = os.urandom(8).hex(), itertools.count()


_draw()
os.register_at_fork(after_in_child=_draw)


def new() -> str:
    """A new call id."""
    return f"{_prefix}{next(_count):016x}"
