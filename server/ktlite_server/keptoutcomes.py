"""A finished call's outcomes, kept by its pod to answer a duplicate delivery of the call
(``PodCalls.finished``), as tuples of plain values: the collector stops tracking those, where
an :class:`~ktlite_server.ranks.Outcome`, a view and its buffer per rank stayed tracked (with
64 ranks, 256 kept calls were 50,000 tracked objects, and each full collection that the new
ones triggered, every ~150 calls, walked them all: a pause in a call's tail).
"""

from __future__ import annotations

from typing import Any

from ktlite_server.ranks import Outcome
from ktlite_wire.status import Status

KEEP_INLINE = 4096  # a kept outcome's value up to this size is copied into plain bytes
_OK = Status.OK
Kept = tuple[Any, ...]  # a finished call's outcomes as plain values: see keep()


def keep(outs: list[Outcome]) -> Kept:
    """A finished call's outcomes as tuples of plain values (see the module's docstring); a
    large value, or one its rank still writes, keeps its Outcome."""
    return tuple(
        [  # (a list, not a generator: a generator is resumed once per rank)
            (
                o.rank,
                "ok" if o.status is _OK else _plain(o.status),  # (one call less per rank)
                bytes(o.data) if o.data is not None else None,
                o.message,
                o.at,
                o.holds_args,
            )
            if o.feed is None and o.path is None and (o.data is None or len(o.data) <= KEEP_INLINE)
            else o
            for o in outs
        ]
    )


def _plain(status: Status | str) -> str:
    """A status as a plain ``str`` (an enum member is a tracked object; its value is not)."""
    return status.value if isinstance(status, Status) else str(status)


def kept(outs: Kept) -> list[Outcome]:
    """The outcomes :func:`keep` kept."""
    return [
        o
        if isinstance(o, Outcome)
        else Outcome(o[0], Status(o[1]), o[2], o[3], at=o[4], holds_args=o[5])
        for o in outs
    ]
