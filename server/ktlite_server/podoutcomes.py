"""A pod's rank outcomes (``ranks.Outcome``, the server's view) as they leave the pod: the
wire's ``RankOutcome`` rows of its answer, whether that answer is a ``CallResult`` (the
coordinator's own ranks, a ``POST /call``) or a member's ``DONE`` (``memberrun``).

A value small enough to travel inline goes as the bytes its rank sent. A large one waits in a
shared-memory file: handed over by name when the caller shares this host and maps the file
itself (``shm_results``), else mapped here so that its bytes are sent.
"""

from __future__ import annotations

import os

from ktlite_server.ranks import Outcome
from ktlite_server.resultfeed import take
from ktlite_wire.outcome import RankOutcome, ShmRef
from ktlite_wire.status import Status

_new = tuple.__new__


def to_wire(pod: str, outs: list[Outcome], shm_results: bool) -> list[RankOutcome]:
    """The rows of pod ``pod``'s answer for ``outs``."""
    return [
        # the tuple made directly: a NamedTuple's own __new__ is a Python call, once per rank
        _new(RankOutcome, (o.rank, pod, o.status, o.data, o.message, o.at))
        if o.path is None
        else _large(pod, o, shm_results)
        for o in outs
    ]


def _large(pod: str, o: Outcome, shm_results: bool) -> RankOutcome:
    assert o.path is not None
    if not os.path.exists(o.path):  # a duplicate request: the first one took the file
        return RankOutcome(
            o.rank,
            pod,
            Status.CANCELLED,
            None,
            f"its result ({o.size} bytes) was already delivered to an earlier request with "
            "this call id; large results are not kept",
            o.at,
        )
    data = ShmRef(o.path, o.size) if shm_results else take(o.path, o.size, o.feed)
    return RankOutcome(o.rank, pod, o.status, data, o.message, o.at)
