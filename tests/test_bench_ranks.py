"""``bench/bench_ranks.py`` (starting N ranks, issue 26) at a small size, ktlite's rows only, so
it cannot rot: both rows deploy 2 ranks, check how they were started (forked by the pod's
zygote; exec'd with ``KTLITE_RANK_ZYGOTE=0``), and print and write their numbers. Nothing here
reads a time: the bench's numbers are for ``bench/README.md``, not for the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.timeout(300)
def test_the_ktlite_rows_run_and_print_their_table(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_ranks.py"), "--skip-peers", "--quick"]
        + ["--ranks", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["errors"] == {}, got["errors"]
    assert list(got["samples"]) == ["2"]
    rows = got["samples"]["2"]
    assert list(rows) == ["ktlite, forked ranks", "ktlite, exec'd ranks"]
    forked, execd = rows["ktlite, forked ranks"], rows["ktlite, exec'd ranks"]
    assert len(forked) == 1 and len(execd) == 1
    # the pod server, its zygote and 2 ranks; the pod server and 2 ranks
    assert (forked[0]["procs"], execd[0]["procs"]) == (4, 3)
    assert "zygote" in forked[0]["how"] and "ktlite_server.rank" in execd[0]["how"]
    for sample in (forked[0], execd[0]):
        assert sample["wall_s"] >= sample["to_s"] > 0 and sample["call_s"] > 0
        assert sample["cpu_s"] > 0 and sample["pss_mib"] > 0
    assert got["load"] and all("before" in s for s in got["load"])
    table = proc.stdout
    assert "N  system" in table and "x cold" in table and "load average (1 min)" in table
    lines = [line for line in table.splitlines() if line.startswith("2  ktlite")]
    assert len(lines) == 2 and lines[1].split()[-3:] != ["-", "-", "-"], table
