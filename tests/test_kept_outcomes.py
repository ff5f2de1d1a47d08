"""A finished call's outcomes, kept by the pod to answer a duplicate delivery of the call
(``keptoutcomes.keep`` / ``keptoutcomes.kept``), are plain values the garbage collector does not track: with
64 ranks, 256 kept calls as Outcome objects were 50,000 tracked objects that every full
collection walked, a pause in a call's tail (issue 26, item 4)."""

from __future__ import annotations

import gc

from ktlite_server.keptoutcomes import KEEP_INLINE, keep, kept
from ktlite_server.ranks import Outcome
from ktlite_wire.status import Status


def _outs() -> list[Outcome]:
    return [
        Outcome(r, Status.OK, memoryview(bytearray(b"value %d" % r)), at=100.0 + r)
        for r in range(64)
    ] + [Outcome(64, Status.ERROR, b"traceback", "rank 64 failed", at=7.0)]


def test_kept_outcomes_read_back_as_they_were() -> None:
    outs = _outs()
    again = kept(keep(outs))
    assert [(o.rank, o.status, bytes(o.data), o.message, o.at) for o in again] == [
        (o.rank, o.status, bytes(o.data), o.message, o.at) for o in outs
    ]


def test_kept_outcomes_are_not_tracked_by_the_collector() -> None:
    held = keep(_outs())
    # a tuple of plain values is untracked by a collection that sees it so; the outer one at
    # the collection after its rows were
    gc.collect()
    gc.collect()
    assert not gc.is_tracked(held)
    assert not any(gc.is_tracked(o) for o in held)


def test_a_large_or_unfinished_value_keeps_its_outcome() -> None:
    large = Outcome(0, Status.OK, bytes(KEEP_INLINE + 1))
    in_file = Outcome(1, Status.OK, None, path="/dev/shm/ktlite-result-x", size=10)
    held = keep([large, in_file])
    assert held[0] is large and held[1] is in_file
    assert kept(held) == [large, in_file]


def test_a_status_given_as_its_text_is_kept_too() -> None:
    (out,) = kept(keep([Outcome(3, "cancelled", None, "stopped")]))  # type: ignore[arg-type]
    assert (out.rank, out.status, out.message) == (3, Status.CANCELLED, "stopped")
