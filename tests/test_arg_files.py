"""Warm argument files (issue 26, item 5): a large argument lands in the shared-memory file of
an earlier call once no rank maps that one any more, and never in one a rank still maps.

Real pods of the local backend: over HTTP (``KTLITE_SHM=0``: the pod server receives the body
into its file, as on Kubernetes and SSH) and on the caller's host (the caller writes the
file). A rank finds the file its argument array lives in from ``/proc/self/maps``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

import ktlite as kt
from ktlite_wire import argfiles
from ktlite_wire.keepbudget import OwnBudget
from ktlite_wire.outcome import CallResult, RankOutcome, ReadResult, Subtree
from ktlite_wire.status import Status

N = 3 << 18  # float32s: 3 MiB, past shm.INLINE_MAX


def mapped_from(x: np.ndarray) -> str:
    """The file ``x``'s memory is mapped from ('' when none)."""
    addr = x.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[5] if len(fields) > 5 else ""
    return ""


class Keeper:
    """Keeps the argument of a call made with ``keep``: its array stays a view of its file."""

    def __init__(self) -> None:
        self.kept: np.ndarray | None = None

    def where(self, x: np.ndarray, keep: bool = False, fork: bool = False) -> tuple:
        path = mapped_from(x)
        if keep:
            self.kept = x
        if fork:  # a child forked while the argument is mapped maps it too
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        kept = None if self.kept is None else (float(self.kept.min()), float(self.kept.max()))
        return path, float(x[0]), kept

    def drop(self) -> None:
        self.kept = None


@pytest.fixture(scope="module")
def keeper() -> Iterator[object]:
    remote = kt.cls(Keeper).to(kt.Compute(stream_logs=False), name="argfiles-keeper")
    yield remote
    remote.teardown()


@pytest.fixture(params=["http", "same-host"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("KTLITE_SHM", "0" if request.param == "http" else "1")
    return str(request.param)


def _full(v: float) -> np.ndarray:
    return np.full(N, v, dtype=np.float32)


def test_an_argument_lands_in_the_file_the_last_one_left(keeper, path) -> None:
    first, v1, _ = keeper.where(_full(1.0))
    second, v2, _ = keeper.where(_full(2.0))
    assert "ktlite-arg-" in first and (v1, v2) == (1.0, 2.0)
    assert second == first  # warm: its pages were there


def test_a_file_a_rank_still_maps_is_never_written_again(keeper, path) -> None:
    keeper.drop()
    kept_in, _, kept = keeper.where(_full(3.0), keep=True)
    assert kept == (3.0, 3.0)
    for v in (4.0, 5.0, 6.0):
        other, got, kept = keeper.where(_full(v))
        assert got == v and other != kept_in
        assert kept == (3.0, 3.0)  # the array the rank kept is intact
    keeper.drop()


def test_a_fork_while_mapped_keeps_the_file_from_reuse(keeper, path) -> None:
    keeper.drop()
    keeper.where(_full(7.0))  # a file free for the next
    forked, _, _ = keeper.where(_full(8.0), fork=True)
    after, v, _ = keeper.where(_full(9.0))
    assert v == 9.0 and after != forked  # the child's mapping was never seen to go


def test_the_pool_reuses_about_the_size_and_stays_bounded() -> None:
    files = argfiles.ArgFiles(OwnBudget(10 << 20), remove=os.unlink)
    a = files.take(4 << 20)
    files.give_back(a, reusable=True)
    b = files.take(4 << 20)
    assert b.path == a.path and b.warm and files.reused == 1
    files.give_back(b, reusable=False)  # a rank may map it: removed, never handed out again
    assert not os.path.exists(b.path)
    c = files.take(4 << 20)
    assert c.path != b.path and not c.warm
    files.give_back(c, reusable=True)
    d = files.take(1 << 20)  # much smaller: not the 4 MiB one
    assert d.path != c.path
    files.give_back(d, reusable=True)
    e = files.take(8 << 20)  # room within 10 MiB: the oldest free file goes
    assert not os.path.exists(argfiles._free_name(c.path))
    files.give_back(e, reusable=True)
    assert files.free_bytes() <= 10 << 20
    assert not os.path.exists(d.path) and os.path.exists(argfiles._free_name(d.path))
    files.clear()
    assert not os.path.exists(argfiles._free_name(d.path))
    assert not os.path.exists(argfiles._free_name(e.path))


def test_a_call_result_says_how_many_ranks_hold_the_file() -> None:
    inner = CallResult([RankOutcome(1, "p1", Status.OK, b"v")], held=2)
    outer = CallResult(
        [RankOutcome(0, "p0", Status.OK, b"v")],
        subtrees=[Subtree.peek(inner.encode_bytes())],
        held=1,
    )
    read = ReadResult(outer.encode_bytes())
    assert read.held == 3 and read.all_ok()
    assert ReadResult(CallResult([RankOutcome(0, "p0", Status.OK, b"v")]).encode_bytes()).held == 0
