"""A call's result as relays pass it on (issue 26): each relay sends its own ranks' outcomes
and its children's results as they came (``CallResult.subtrees``), reading only their heads'
summary (``Subtree.peek``), but for a child's small answer (a leaf pod's), whose rows and runs
it lifts into its own; the caller reads them all (``ReadResult``), and a call whose every rank
returned a value is decoded without a record per rank (``decode_values``)."""

from __future__ import annotations

from typing import Any

import pytest

from ktlite.modes.outcomes import decode_values, split
from ktlite_wire import codec, envelope
from ktlite_wire.errors import ProtocolError
from ktlite_wire.outcome import (
    LIFT_MAX,
    SAME_MAX,
    CallResult,
    RankOutcome,
    ReadResult,
    ShmRef,
    Subtree,
)
from ktlite_wire.status import Status

NONE = codec.dumps(None)


def _pod(p: int, ranks: int = 2, value: bytes = NONE) -> list[RankOutcome]:
    return [RankOutcome(p * ranks + r, f"p-{p}", Status.OK, value) for r in range(ranks)]


def _sent(result: CallResult) -> bytearray:
    return bytearray(result.encode_bytes())  # as a frame parser hands it over: writable


def _tree() -> tuple[bytearray, list[bytearray]]:
    """Pod 0 relaying to pod 1 (which relays to 2 and 3) and to pod 4 (a leaf)."""
    leaves = [_sent(CallResult(_pod(p))) for p in (2, 3, 4)]
    relay = _sent(CallResult(_pod(1), subtrees=[Subtree.peek(b) for b in leaves[:2]]))
    root = _sent(CallResult(_pod(0), subtrees=[Subtree.peek(relay), Subtree.peek(leaves[2])]))
    return root, [relay, *leaves]


def _nested(data: bytearray) -> Subtree:
    """A child's answer as a relay passes on a large one: nested, not lifted."""
    return Subtree.peek(data)._replace(head=None, bufs=None)


def _big(p: int) -> bytearray:
    """A pod whose every rank failed with its own error: one row each, too many to lift."""
    ranks = LIFT_MAX + 1
    outs = [
        RankOutcome(p * 100 + r, f"p-{p}", Status.ERROR, codec.dumps(r), "boom", 1.0)
        for r in range(ranks)
    ]
    return _sent(CallResult(outs))


def test_a_relay_lifts_small_answers_and_passes_large_ones_on_byte_for_byte() -> None:
    """A leaf's answer (a run for its ranks that returned a value) is lifted into its relay's
    result: the caller reads one message per relay, not one per pod (at 1,000 pods, 1,000
    messages of one run each). An answer of more rows and runs than ``LIFT_MAX`` is nested as
    it came: the relay's work per child stays bounded, whatever its ranks."""
    root, below = _tree()
    header, bufs = envelope.decode(root)
    assert "subtrees" not in header and header["outcomes"] == []
    assert [run[0] for run in header["runs"]] == [0, 2, 4, 6, 8]  # every pod's run, lifted
    big = _big(3)
    relay = _sent(CallResult(_pod(1), subtrees=[Subtree.peek(below[1]), Subtree.peek(big)]))
    header, bufs = envelope.decode(relay)
    assert [bytes(bufs[i]) for i in header["subtrees"]] == [bytes(big)]  # as sent
    assert [run[0] for run in header["runs"]] == [2, 4]  # its own, and pod 2's lifted
    read = ReadResult(relay)
    assert [o.rank for o in read.outcomes] == [2, 3, 4, 5] + list(range(300, 300 + LIFT_MAX + 1))
    assert codec.loads(read.outcomes[5].data) == 1  # a lifted row's buffer still its own


def test_a_lifted_answer_that_is_not_as_this_wire_writes_it_is_nested_for_the_caller() -> None:
    """A child's head that a relay cannot lift (a run naming a buffer by a string) is nested
    as it came, and the caller says what is wrong."""
    header, bufs = envelope.decode(bytearray(CallResult(_pod(2)).encode_bytes()))
    header["runs"][0][3] = "zero"
    odd = bytearray(envelope.encode_bytes(header, bufs))
    relay = _sent(CallResult(_pod(1), subtrees=[Subtree.peek(odd)]))
    assert [bytes(b) for b in envelope.decode(relay)[1][-1:]] == [bytes(odd)]
    with pytest.raises(ProtocolError, match="malformed run"):
        ReadResult(relay)


def test_the_caller_reads_every_subtree_in_rank_order() -> None:
    root, _ = _tree()
    read = ReadResult(root)
    assert [o.rank for o in read.outcomes] == list(range(10))
    assert [o.pod for o in read.outcomes] == [f"p-{r // 2}" for r in range(10)]
    assert CallResult.decode(root).outcomes == read.outcomes
    assert decode_values(read.values() or []) == [None] * 10
    assert not read.rows and len(read.runs) == 5  # one run per pod, no record per rank


def test_a_failure_below_a_relay_reaches_the_caller_and_the_relay_summary() -> None:
    boom = codec.dumps("info")
    leaf = _pod(2)
    leaf[1] = RankOutcome(5, "p-2", Status.ERROR, boom, "", 7.5)
    leaf_bytes = _sent(CallResult(leaf))
    peeked = Subtree.peek(leaf_bytes)
    assert (peeked.failed, peeked.not_ok) == (5, 1)
    stopped = RankOutcome(3, "p-1", Status.CANCELLED, None, "stopped because rank 5 failed", 8.0)
    relay = CallResult([_pod(1)[0], stopped], subtrees=[peeked])
    assert relay.summary() == (5, 2)  # a stop is not a failure of its own, but not OK
    read = ReadResult(_sent(relay))
    assert read.values() is None  # not every rank returned a value
    statuses = [(o.rank, o.status, o.at) for o in read.outcomes]
    assert statuses == [
        (2, Status.OK, 0),
        (3, Status.CANCELLED, 8.0),
        (4, Status.OK, 0),
        (5, Status.ERROR, 7.5),
    ]
    assert bytes(read.outcomes[3].data) == boom


def test_values_in_shared_memory_and_rows_keep_their_records() -> None:
    outs = [
        RankOutcome(0, "p-0", Status.OK, NONE),
        RankOutcome(1, "p-0", Status.OK, ShmRef("/dev/shm/ktlite-res-x", 9)),
        RankOutcome(2, "p-0", Status.OK, None),
        RankOutcome(3, "p-0", Status.OK, NONE),
    ]
    read = ReadResult(_sent(CallResult(outs)))
    assert read.values() is None
    assert [
        (o.rank, o.data if not isinstance(o.data, memoryview) else "buf") for o in read.outcomes
    ] == [
        (0, "buf"),
        (1, ShmRef("/dev/shm/ktlite-res-x", 9)),
        (2, None),
        (3, "buf"),
    ]


def test_a_run_of_equal_small_values_travels_once_distinct_or_large_ones_each() -> None:
    big = codec.dumps(b"x" * SAME_MAX)
    outs = _pod(0, 3) + _pod(1, 3, codec.dumps([1, 2])) + _pod(2, 3, big)
    outs += [RankOutcome(9 + r, "p-3", Status.OK, codec.dumps(r)) for r in range(3)]
    header, bufs = envelope.decode(_sent(CallResult(outs)))
    assert [run[4] for run in header["runs"]] == [1, 1, 3, 3]  # buffers per run
    assert len(bufs) == 1 + 1 + 3 + 3
    values = decode_values(ReadResult(_sent(CallResult(outs))).values() or [])
    assert values is not None
    assert values == [None] * 3 + [[1, 2]] * 3 + [b"x" * SAME_MAX] * 3 + [0, 1, 2]
    values[3].append(3)  # each rank's list is its own object, though its bytes came once
    assert values[4] == [1, 2] and values[5] == [1, 2]


def test_equal_immutable_values_are_decoded_once_mutable_ones_for_each_rank() -> None:
    assert decode_values([NONE] * 4) == [None] * 4
    lists = decode_values([codec.dumps([1, 2])] * 3)
    assert lists == [[1, 2]] * 3
    assert lists is not None
    lists[0].append(3)  # each rank's list is its own object
    assert lists[1:] == [[1, 2], [1, 2]]
    mixed = [codec.dumps(v) for v in (7, 7, "a", "a", 7)]
    assert decode_values(mixed) == [7, 7, "a", "a", 7]


def test_a_value_that_does_not_decode_leaves_it_to_split_to_name_the_rank() -> None:
    bad = codec.dumps(None)[:-1] + b"\x00"  # a truncated pickle stream
    outs = [RankOutcome(0, "p-0", Status.OK, NONE), RankOutcome(1, "p-0", Status.OK, bad)]
    read = ReadResult(_sent(CallResult(outs)))
    blobs = read.values()
    assert blobs is not None and decode_values(blobs) is None
    failures, values = split(read.outcomes)
    assert values == {0: None} and [f.rank for f in failures] == [1]


def _with(header_change: dict[str, Any], nest: int = 0) -> bytes:
    inner = CallResult(_pod(1)).encode_bytes()
    for _ in range(nest):
        inner = CallResult([], subtrees=[_nested(bytearray(inner))]).encode_bytes()
    header, bufs = envelope.decode(bytearray(inner))
    header.update(header_change)
    return envelope.encode_bytes(header, bufs)


@pytest.mark.parametrize(
    "change",
    [
        {"subtrees": 3},
        {"subtrees": [9]},
        {"subtrees": [None]},
        {"runs": {"a": 1}},
        {"runs": [[0, 2, "p", 5, 2]]},
        {"runs": [[0, 2, "p", 0, 3]]},
        {"runs": [[0, 2, "p", 0, 0]]},
        {"runs": [[0, 0, "p", 0, 1]]},
        {"runs": [["0", 1, "p", 0, 1]]},
        {"runs": [[0, 1, "p", 0]]},
    ],
)
def test_a_malformed_result_is_a_protocol_error(change: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        ReadResult(bytearray(_with(change)))


def test_a_relay_refuses_a_child_head_without_its_summary_and_nesting_is_bounded() -> None:
    with pytest.raises(ProtocolError, match="not_ok"):
        Subtree.peek(bytearray(_with({"not_ok": None})))
    with pytest.raises(ProtocolError, match="failed"):
        Subtree.peek(bytearray(_with({"failed": "rank 3"})))
    with pytest.raises(ProtocolError, match="deeper"):
        ReadResult(bytearray(_with({}, nest=40)))
    assert len(ReadResult(bytearray(_with({}, nest=20))).outcomes) == 2
