"""``bench/bench_ab.py`` (the before/after bench): its driver runs every row against this tree
through the public API alone, and its table reads the ratios the right way round.

The driver is what the before/after run depends on while ktlite's modules move; a change of
the public API that breaks it shows here, not at the end of a session's bench run.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

import ktlite

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def ab(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("bench_ab")


def test_change_reads_times_and_rates_the_right_way_round(ab: ModuleType) -> None:
    assert ab.change(0.010, 0.005, rate=False) == ("0.50", "2.00x faster")
    assert ab.change(0.010, 0.020, rate=False) == ("2.00", "2.00x slower")
    assert ab.change(100.0, 200.0, rate=True) == ("2.00", "2.00x faster")
    assert ab.change(100.0, 50.0, rate=True) == ("0.50", "2.00x slower")
    assert ab.change(1.0, 1.001, rate=False) == ("1.00", "same")
    assert ab.change(None, 1.0, rate=False) == ("-", "-")


def test_table_shows_a_missing_side_as_a_dash(ab: ModuleType) -> None:
    warm = next(s for s in ab.SHAPES if s.key == "warm")
    submit = next(s for s in ab.SHAPES if s.key == "submit")
    samples = {"before": {"warm_call": [[0.002], [0.004]], "submit": [[500.0]]}, "after": {}}
    rows = ab.table([warm, submit], samples, {"before": {"warm": 3.0}, "after": {}})
    assert [r[0] for r in rows] == [
        "warm call, 1 pod, no-op, p50",
        "warm call, 1 pod, no-op, p99",
        "100 submitted calls, concurrency 8, median",
        "cold .to() (warm: 1 pod), 1 sample",
    ]
    assert rows[0][1:] == ["2.00 ms", "-", "-", "-", "-"]
    assert rows[1][1] == "4.00 ms"
    assert rows[2][1:3] == ["500 calls/s", "-"]


def test_per_round_ratios_pair_each_round_of_both_sides(ab: ModuleType) -> None:
    warm = next(s for s in ab.SHAPES if s.key == "warm")
    samples = {
        "before": {"warm_call": [[1.0, 1.0, 9.0], [2.0], [4.0]]},
        "after": {"warm_call": [[1.5], [1.0]]},  # left out after its second round
    }
    p50, p99 = ab.table([warm], samples, {"before": {}, "after": {}})
    assert p50[1:] == ["2.00 s", "1.00 s", "0.50", "2.00x faster", "0.50-1.50"]
    assert p99[5] == ""


def test_driver_runs_each_row_on_this_tree(ab: ModuleType, tmp_path: Path) -> None:
    from _peer_link import PeerProcess

    peer = PeerProcess(
        "driver",
        [sys.executable, str(BENCH / "_ab_driver.py")],
        start_timeout=120,
        env=ab.driver_env(str(tmp_path)),
        cwd=str(tmp_path),
    )
    try:
        assert peer.ready["ktlite_dir"] == os.path.dirname(os.path.abspath(ktlite.__file__))
        got = peer.ask(
            "deploy", 240, key="t", name="ab-test", workers=1, num_proc=2, concurrency=None
        )
        assert got["world"] == 2
        root = os.path.dirname(peer.ready["ktlite_dir"])
        assert got["rank_modules"]  # the pod server's packages at least
        assert all(f.startswith(root + os.sep) for f in got["rank_modules"].values() if f)
        calls = peer.ask("measure", 120, key="t", row="call", n=2, warmup=1)
        perrank = peer.ask("measure", 120, key="t", row="perrank", n=1, warmup=0)
        submit = peer.ask("measure", 120, key="t", row="submit", n=1, warmup=0)
        assert len(calls) == 2 and len(perrank) == 1 and len(submit) == 1
        assert all(s > 0 for s in [*calls, *perrank, *submit])
        with pytest.raises(RuntimeError, match="unknown row 'nope'; the rows are call"):
            peer.ask("measure", 60, key="t", row="nope", n=1, warmup=0)
        peer.ask("teardown", 120, key="t")
        with pytest.raises(RuntimeError, match="no deployment 't': deploy it first"):
            peer.ask("measure", 60, key="t", row="call", n=1, warmup=0)
    finally:
        peer.close()
