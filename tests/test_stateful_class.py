"""Real-process tests of kt.cls on the local backend (issue 2, point 3).

A deployed class is constructed once per rank; method calls run on that live instance,
so its state persists between calls, and a distributed class keeps one state per rank.
"""

from __future__ import annotations

import os
import uuid

import pytest

import ktlite as kt


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Counter:
    def __init__(self, start=0, step=1, label="counter"):
        self.value = start
        self.step = step
        self.label = label
        self.calls = 0
        self.rank = int(os.environ.get("RANK", "0"))

    def incr(self, n=1):
        self.calls += 1
        self.value += n * self.step
        return self.value

    def add_rank_scaled(self, x):
        """Each rank adds a different amount, so each keeps a different state."""
        self.calls += 1
        self.value += x * (self.rank + 1)
        return {
            "rank": self.rank,
            "env_rank": int(os.environ["RANK"]),
            "value": self.value,
            "calls": self.calls,
            "pid": os.getpid(),
        }

    def snapshot(self):
        return {
            "value": self.value,
            "step": self.step,
            "label": self.label,
            "calls": self.calls,
            "pid": os.getpid(),
        }


@pytest.fixture(scope="module")
def counter():
    remote = kt.cls(Counter, name=unique("counter")).to(kt.Compute(cpus=1), init_args={"start": 10})
    yield remote
    remote.teardown()


def test_state_persists_between_method_calls(counter):
    before = counter.snapshot()
    assert before["value"] == 10 and before["calls"] == 0 and before["label"] == "counter"
    assert counter.incr() == 11
    assert counter.incr(5) == 16
    assert counter.incr(n=4) == 20
    after = counter.snapshot()
    assert after["value"] == 20 and after["calls"] == 3
    assert after["pid"] == before["pid"] != os.getpid()


def test_init_args_dict():
    remote = kt.cls(Counter, name=unique("ctr-kw")).to(
        kt.Compute(cpus=1), init_args={"start": 5, "step": 3, "label": "kw"}
    )
    try:
        snap = remote.snapshot()
        assert (snap["value"], snap["step"], snap["label"]) == (5, 3, "kw")
        assert remote.incr(2) == 11
    finally:
        remote.teardown()


def test_init_args_tuple():
    remote = kt.cls(Counter, name=unique("ctr-pos")).to(
        kt.Compute(cpus=1), init_args=(100, 2, "pos")
    )
    try:
        snap = remote.snapshot()
        assert (snap["value"], snap["step"], snap["label"]) == (100, 2, "pos")
        assert remote.incr() == 102
        assert remote.incr() == 104
    finally:
        remote.teardown()


def test_unknown_method_is_an_attribute_error(counter):
    with pytest.raises(AttributeError):
        counter.no_such_method  # noqa: B018


def test_distributed_class_keeps_state_per_rank():
    remote = kt.cls(Counter, name=unique("ctr-dist")).to(
        kt.Compute(cpus=1).distribute("pytorch", workers=2, num_proc=2), init_args={"start": 0}
    )
    try:
        first = remote.add_rank_scaled(1)
        assert isinstance(first, list) and len(first) == 4
        for r, res in enumerate(first):
            assert res["rank"] == r and res["env_rank"] == r
            assert res["value"] == r + 1 and res["calls"] == 1
        second = remote.add_rank_scaled(10)
        for r, res in enumerate(second):
            assert res["value"] == (r + 1) * 11, f"rank {r} lost or shared its state"
            assert res["calls"] == 2
            assert res["pid"] == first[r]["pid"]
        assert len({res["pid"] for res in second}) == 4
        snaps = remote.snapshot()
        assert [s["value"] for s in snaps] == [11, 22, 33, 44]
    finally:
        remote.teardown()
