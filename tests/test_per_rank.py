"""Per-rank arguments (``kt.per_rank``, ``remote.each``): each rank gets its own item, and
only its pod receives it; shared arguments reach each pod once."""

from __future__ import annotations

import os

import pytest

import ktlite as kt
from ktlite.net import rankdata
from ktlite.net.packaging import encode_ranked_call
from ktlite_wire import codec
from ktlite_wire import rankdata as wire_rankdata


def show(x: object = None, shared: object = None, scale: int = 1) -> tuple:
    size = len(shared) if isinstance(shared, (bytes, bytearray)) else shared
    return int(os.environ["RANK"]), x, size, scale


class Worker:
    def __init__(self) -> None:
        self.calls = 0

    def take(self, item: object, bonus: int = 0) -> tuple:
        self.calls += 1
        return int(os.environ["RANK"]), item, bonus

    def count(self) -> int:
        return self.calls


@pytest.fixture(scope="module")
def spread():
    remote = kt.fn(show).to(
        kt.Compute(env={"KTLITE_LOG_CALL_BODIES": "1"}).distribute(
            "pytorch", workers=2, num_proc=2
        ),
        name="pr-show",
    )
    yield remote
    remote.teardown()


def test_each_gives_rank_r_item_r(spread) -> None:
    assert spread.each(["a", "b", "c", "d"], scale=3) == [
        (0, "a", None, 3),
        (1, "b", None, 3),
        (2, "c", None, 3),
        (3, "d", None, 3),
    ]


def test_per_rank_keyword_beside_shared_ones(spread) -> None:
    got = spread(x=kt.per_rank([10, 11, 12, 13]), shared=b"abc")
    assert got == [(r, 10 + r, 3, 1) for r in range(4)]
    fut = spread.submit(kt.per_rank(["p", "q", "r", "s"]))
    assert [g[1] for g in fut.result(timeout=60)] == ["p", "q", "r", "s"]


def test_wrong_length_is_a_config_error_before_anything_runs() -> None:
    remote = kt.cls(Worker).to(kt.Compute().distribute("pytorch", workers=2), name="pr-worker")
    try:
        with pytest.raises(kt.ConfigError, match="3 item.*2 rank"):
            remote.take.each([1, 2, 3])
        with pytest.raises(kt.ConfigError, match="one item per rank"):
            remote.take(kt.per_rank("ab"))
        assert remote.count() == [0, 0]  # nothing ran
        assert remote.take.each([{"a": 1}, {"b": 2}], bonus=7) == [
            (0, {"a": 1}, 7),
            (1, {"b": 2}, 7),
        ]
        assert remote.count() == [1, 1]
    finally:
        remote.teardown()


def test_each_pod_receives_only_its_own_items_and_the_shared_argument_once(
    spread, monkeypatch
) -> None:
    monkeypatch.setenv("KTLITE_SHM", "0")  # over HTTP, as between machines
    shared = os.urandom(1 << 20)
    items = [bytes([r]) * (200 << 10) for r in range(4)]
    got = spread(x=kt.per_rank(items), shared=shared)
    assert [(g[0], g[2]) for g in got] == [(r, 1 << 20) for r in range(4)]
    log = spread.logs()
    member = [ln for ln in log.splitlines() if ln.startswith("[pr-show-1]") and "received" in ln][
        -1
    ]
    received = int(member.split("received ")[1].split()[0])
    # 1 MiB shared + ranks 2 and 3's 200 KiB each, plus framing: not 4 items, not 1 MiB twice
    assert (1 << 20) + 2 * (200 << 10) <= received < (1 << 20) + 3 * (200 << 10), received
    items_line = [
        ln for ln in log.splitlines() if ln.startswith("[pr-show-1]") and "per-rank items" in ln
    ][-1]
    assert "rank 2:" in items_line and "rank 3:" in items_line and "rank 0:" not in items_line


def test_split_and_fill_are_inverse() -> None:
    args, kwargs, items = rankdata.split(
        (1, kt.per_rank(["x", "y"])), {"k": kt.per_rank([5, 6]), "z": 9}, 2
    )
    assert items == [("x", 5), ("y", 6)]
    assert wire_rankdata.fill(args, kwargs, items[1]) == ((1, "y"), {"k": 6, "z": 9})
    same = rankdata.split((1,), {"z": 2}, 3)
    assert same == ((1,), {"z": 2}, None)


def test_wire_layout_offsets_cover_each_rank() -> None:
    parts, layout = encode_ranked_call("m", (kt.per_rank([b"a" * 10, b"b" * 20]),), {}, 2)
    body = b"".join(bytes(memoryview(p)) for p in parts)
    assert layout is not None and layout["base"] == 0
    (o0, n0), (o1, n1) = layout["items"]
    assert o0 == layout["shared"] and o1 == o0 + n0 and o1 + n1 == len(body)
    assert codec.loads(body[o1 : o1 + n1]) == (b"b" * 20,)


@pytest.mark.parametrize(
    "bad",
    [
        {"shared": -1, "items": []},
        {"shared": 1, "items": [[1]]},
        {"shared": 1, "items": "x"},
        [1, 2],
    ],
)
def test_a_bad_plan_is_refused(bad) -> None:
    with pytest.raises(ValueError):
        wire_rankdata.check_plan(bad)


def test_sharded_dispatch_by_named_axes(spread) -> None:
    # dp=2 x tp=2: ranks 0,1 hold dp shard 0, ranks 2,3 dp shard 1; one result per dp shard
    got = spread.sharded(
        ["first", "second"],
        layout={"dp": 2, "tp": 2},
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
    )
    assert got == [(0, "first", None, 1), (2, "second", None, 1)]
    # sharded on both axes: nested lists, one result per rank
    got = spread.sharded(
        [["a", "b"], ["c", "d"]], layout={"dp": 2, "tp": 2}, in_sharded_axes=["dp", "tp"]
    )
    assert [g[1] for g in got] == ["a", "b", "c", "d"]
    with pytest.raises(kt.ConfigError, match="covers 6"):
        spread.sharded([1, 2], layout={"dp": 2, "tp": 3}, in_sharded_axes=["dp"])
    with pytest.raises(kt.ConfigError, match="3 shard"):
        spread.sharded([1, 2, 3], layout={"dp": 2, "tp": 2}, in_sharded_axes=["dp"])


def test_layout_maths() -> None:
    from ktlite.api.sharding import Layout

    lay = Layout({"dp": 2, "tp": 2})
    assert [lay.coords(r) for r in (1, 2)] == [{"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}]
    assert lay.rank({"dp": 1, "tp": 1}) == 3
    assert lay.leaders(["dp"], ["tp"]) == [0, 2] and lay.leaders(["tp"], ["dp"]) == [0, 1]
    with pytest.raises(kt.ConfigError, match="neither"):
        lay.check_axes(["dp"], [])


def test_ranks_option_runs_only_those_ranks(spread) -> None:
    assert spread.options(ranks=[2])(x="only") == [(2, "only", None, 1)]
    assert spread.options(ranks=[3, 0])(x=1) == [(0, 1, None, 1), (3, 1, None, 1)]
    with pytest.raises(kt.ConfigError, match="ranks="):
        spread.options(ranks=[4])()
