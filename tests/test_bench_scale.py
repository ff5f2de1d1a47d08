"""``bench/bench_scale.py`` (the 1,000-pod harness, issue 26 item 1) at a small size, so it
cannot rot: it deploys on simulated pods (real pod servers, in-process ranks), checks its own
values (every rank's 1 KB, the per-rank items back in rank order, every log line), cancels a
call and kills an inner pod mid-call, and prints its table and the targets. Nothing here reads
a time: the harness's numbers are for ``bench/README.md``, not for the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
    assert "| pods | ranks | tree |" in proc.stdout
    for target in ("no-op call p50", "no-op call p99", "code push", "a dead pod", "client memory"):
        assert target in proc.stdout, proc.stdout
