"""``bench/bench_torch_restart.py`` (a torch rank's restart) at its smallest, so it cannot rot:
one rank, two restarts; the table is printed and written, and by the second restart the rank
was forked from a zygote that had torch imported (``rankpreload``). Nothing here reads a time:
the bench's numbers are for ``bench/README.md``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.timeout(300)
def test_the_bench_runs_and_the_last_restart_forks_from_torch(tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_torch_restart.py")]
        + ["--procs", "1", "--rounds", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zygote has torch" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["round"] for r in rows] == ["first call", "restart 1", "restart 2"]
    first, *_, last = rows
    assert len(last["ranks"]) == 1 and last["ranks"][0]["pid"] != first["ranks"][0]["pid"]
    assert last["ranks"][0]["zygote_has_torch"], rows
