"""``bench/bench_scale.py`` (the 1,000-pod harness, issue 26 item 1) at a small size, so it
cannot rot: it deploys on simulated pods (real pod servers, in-process ranks), checks its own
values (every rank's 1 KB, the per-rank items back in rank order, every log line), cancels a
call and kills an inner pod mid-call, and prints its table and the targets. Nothing here reads
a time: the harness's numbers are for ``bench/README.md``, not for the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.timeout(300)
def test_the_harness_runs_through_the_call_tree_at_a_small_size(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    # 7 pods with a fan-out of 2: pod 1 relays to pods 2 and 3, and is the pod it kills
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_scale.py"), "--pods", "1,7", "--calls", "3"]
        + ["--tree", "2", "--json", str(out), "--profile", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["pods"] for r in rows] == [1, 7]
    assert rows[1]["tree"] == "2 (depth 2)", rows[1]
    assert [r["log_lines"] for r in rows] == ["8/8", "56/56"]
    assert rows[1]["dead_named"], rows[1]
    # pod 0 and pod 1 (a relay) measured alone, the call's longest path summed; profiles kept
    assert rows[1]["pod1_cpu_ms"] is not None and rows[1]["serial_cpu_ms"] is not None, rows[1]
    assert (tmp_path / "client-7.prof").exists() and (tmp_path / "pod0-7.prof").exists()
    # the longest path measured apart from the pods off it (bench/_scale_path.py)
    assert all(r["path_p50_ms"] is not None for r in rows), rows
    assert "on the call's longest path" in proc.stdout, proc.stdout
    assert "| pods | ranks | tree |" in proc.stdout
    for target in ("no-op call p50", "no-op call p99", "code push", "a dead pod", "client memory"):
        assert target in proc.stdout, proc.stdout


def test_the_longest_path_is_the_wall_time_less_the_idle_wait_off_it() -> None:
    """``_scale_path.path_times``: pod 0 waits 0.7 s after pod 1's answer for its other
    child's, of which it spends 0.04 s of CPU reading answers; pod 1 waits 0.05 s after its
    first child's answer, 0.01 s of it on CPU; before the call pod 0 probed its children
    (their connections idle too long), pod 1's answering at once and pod 2's 0.1 s later.
    The path keeps the CPU, not the idle waits off it."""
    sys.path.insert(0, str(BENCH))
    from _scale_path import path_times

    records = [
        ["c1", 0, "quorum", -1, 10.00, 1.000],
        ["c1", 0, "probe", 1, 10.01, 1.001],
        ["c1", 0, "probe", 2, 10.11, 1.001],
        ["c1", 0, "answer", 1, 10.2, 1.01],
        ["c1", 0, "answer", 2, 10.9, 1.05],
        ["c1", 1, "answer", 3, 10.10, 2.001],
        ["c1", 1, "answer", 4, 10.15, 2.011],
        ["c0", 0, "answer", 1, 9.5, 0.5],  # another call's, outside this one's span
    ]
    [(wall, path)] = path_times([(10.0, 11.0)], records)
    assert wall == pytest.approx(1.0) and path == pytest.approx(1.0 - 0.66 - 0.04 - 0.1)
    assert path_times([(12.0, 12.5)], records) == [(0.5, 0.5)]  # one pod: nothing fanned out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins to one of two cores")
def test_the_paths_placement_puts_back_every_thread_even_one_started_meanwhile() -> None:
    """A thread started while the path was pinned (a pool's) runs where its process did
    before, not on the path's core for the rest of the run."""
    sys.path.insert(0, str(BENCH))
    from _scale_path import placed

    was = os.sched_getaffinity(0)
    started: list[threading.Thread] = []
    release = threading.Event()
    with placed([os.getpid()], [], []) as ok:
        assert ok and len(os.sched_getaffinity(0)) == 1
        started.append(threading.Thread(target=release.wait, args=(30,)))
        started[0].start()
        assert started[0].native_id is not None
        assert len(os.sched_getaffinity(started[0].native_id)) == 1
    try:
        assert os.sched_getaffinity(started[0].native_id) == was
        assert os.sched_getaffinity(0) == was
    finally:
        release.set()
        started[0].join(30)
