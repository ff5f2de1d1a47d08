"""ktlite against itself in CPU instructions per call: two source trees, every process counted.

    python bench/bench_cpu.py --before-python /tmp/before/.venv/bin/python \\
                              --after-python .venv/bin/python [--rows warm,fanout4] [--calls 50]

Wall-clock time on a shared 2-core machine moves 20-50% from one round to the next with the
load (see bench_ab.py's "per round" column); the number of instructions a process executes
does not. Each side's driver (``bench/_cpu_driver.py``, public API only) runs under valgrind's
callgrind with ``--trace-children=yes``, so the caller, every pod server and every rank process
is counted. The counters are zeroed after a warm-up, dumped after N calls, then dumped again
after a few idle seconds; each process's idle rate, scaled to the measured calls' wall time,
is subtracted (a pod server's heartbeats and timers run whether or not it is called). Rows:

- ``warm``: 1 pod, a no-op call (``stream_logs=False``): thousands of instructions per call;
- ``fanout4`` / ``fanout8``: ``distribute("spmd", workers=N)``, a no-op on every rank;
- ``ranks8``: ``distribute("spmd", num_proc=8)``: one pod of 8 rank processes, a no-op on each;
- ``submit``: 1 pod with ``concurrency=8``, batches of 100 ``.submit()`` futures (per call).

Under valgrind everything runs 20-50x slower: a row takes minutes; the counts are exact to a
percent or so (a timer that fires once more in one run than in the other). Needs ``valgrind``
(``apt-get install valgrind``). The counters are driven with ``callgrind_control``, which
reaches every callgrind process of this user: run one at a time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("warm", "fanout4", "fanout8", "ranks8", "submit")
SUBMIT = 100


def _count(path: Path) -> int:
    """The instructions a callgrind dump counted (its ``summary:`` or ``totals:`` line)."""
    with open(path) as f:
        head = f.read(1 << 16)
    m = re.search(r"^(?:summary|totals): (\d+)", head, re.M)
    return int(m.group(1)) if m else 0


def _kind(cmd: str) -> str | None:
    if "callgrind_control" in cmd:
        return None
    if "ktlite_server.rank" in cmd:
        return "ranks"
    if "ktlite_server" in cmd:
        return "coordinator" if re.search(r"--ordinal 0\b", cmd) else "members"
    if "_cpu_driver.py" in cmd:
        return "caller"
    return None


def run_side(python: str, row: str, calls: int, side: str) -> dict[str, float]:
    """Instructions per call of each kind of process, idle subtracted."""
    with tempfile.TemporaryDirectory(prefix=f"ktlite-cpu-{side}-") as tmp:
        out = Path(tmp) / "cg"
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["KTLITE_HOME"] = str(Path(tmp) / "home")
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--trace-children=yes",
            f"--callgrind-out-file={out}/cg.%p",
            python,
            str(HERE / "_cpu_driver.py"),
            row,
            f"cpu-{side}-{row}",
            str(calls),
        ]
        print(f"[bench] {side}: {row} under callgrind ({calls} calls)", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=3600)
        text = proc.stdout + proc.stderr
        wall = re.search(r"^WALL ([\d.]+)", text, re.M)
        idle = re.search(r"^IDLE ([\d.]+)", text, re.M)
        if proc.returncode != 0 or wall is None or idle is None:
            tail = "\n".join(line for line in text.splitlines() if not line.startswith("=="))
            raise RuntimeError(f"{side} {row} failed (exit {proc.returncode}):\n{tail[-2000:]}")
        scale = float(wall.group(1)) / float(idle.group(1))
        per_call = calls * (SUBMIT if row == "submit" else 1)
        totals: dict[str, float] = {}
        for warm in out.glob("cg.*.1"):
            with open(warm) as f:
                m = re.search(r"^cmd:\s+(.*)$", f.read(1 << 14), re.M)
            kind = _kind(m.group(1)) if m else None
            if kind is None:
                continue
            idle_file = warm.with_name(warm.name[:-2] + ".2")
            idle_count = _count(idle_file) if idle_file.exists() else 0
            net = _count(warm) - idle_count * scale
            totals[kind] = totals.get(kind, 0.0) + net / per_call
        return totals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before-python", required=True)
    ap.add_argument("--after-python", required=True)
    ap.add_argument("--rows", default="warm,fanout4,submit", help=f"some of {', '.join(ROWS)}")
    ap.add_argument("--calls", type=int, default=50, help="measured calls (submit: batches / 10)")
    args = ap.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench_cpu.py needs valgrind: apt-get install valgrind", file=sys.stderr)
        return 2
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"unknown rows {unknown}: choose from {', '.join(ROWS)}", file=sys.stderr)
        return 2
    lines = [
        "thousands of instructions per call, idle subtracted (ratio = after / before)",
        f"{'row':<10} {'process':<12} {'before':>10} {'after':>10} {'ratio':>7}",
    ]
    for row in rows:
        calls = max(1, args.calls // 10) if row == "submit" else args.calls
        # absolute, not resolved: each driver runs in a directory of its own, and a venv's
        # python must keep its own path to find the venv
        before = run_side(os.path.abspath(args.before_python), row, calls, "before")
        after = run_side(os.path.abspath(args.after_python), row, calls, "after")
        for kind in ("caller", "coordinator", "members", "ranks", "total"):
            b = sum(before.values()) if kind == "total" else before.get(kind, 0.0)
            a = sum(after.values()) if kind == "total" else after.get(kind, 0.0)
            if b or a:
                ratio = f"{a / b:7.3f}" if b else "      -"
                lines.append(f"{row:<10} {kind:<12} {b / 1000:>9.0f}k {a / 1000:>9.0f}k {ratio}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
