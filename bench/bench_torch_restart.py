"""A torch rank's restart: how long a ``distribute("pytorch")`` deployment's next call takes
after its ranks died, and what each rank process holds (PSS), on the local backend.

Each round kills every rank (a call that exits), then times the next call: the pod restarts
the ranks (forked from its zygote) and loads the code, which imports torch (a global of the
function). Without a preload every restarted rank imports torch itself; with one
(``rankpreload``: the pod saw torch in its ranks once they had loaded the code) the first
restart makes the pod's torch zygote (one import) and later ones fork it.

    python bench/bench_torch_restart.py [--procs 2] [--rounds 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch  # job's global: a rank imports it as it loads job, as training code does

import ktlite as kt


def _pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def job(mode: str) -> Any:
    if mode == "die":
        os._exit(3)
    zygote = os.getppid()
    return {
        "pid": os.getpid(),
        "pss_kb": _pss_kb(os.getpid()),
        "zygote_pss_kb": _pss_kb(zygote),
        "zygote_has_torch": "libtorch" in Path(f"/proc/{zygote}/maps").read_text(),
        "torch": torch.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    load = os.getloadavg()[0]
    remote = kt.fn(job, name="bench-torch-restart").to(
        kt.Compute(cpus=1, max_restarts=1000).distribute("pytorch", workers=1, num_proc=args.procs)
    )
    rows: list[dict[str, Any]] = []
    try:
        t = time.perf_counter()
        rows.append({"round": "first call", "s": 0.0, "ranks": remote("probe")})
        rows[-1]["s"] = time.perf_counter() - t
        for i in range(1, args.rounds + 1):
            with contextlib.suppress(kt.RemoteError):
                remote("die")
            t = time.perf_counter()
            ranks = remote("probe")
            rows.append({"round": f"restart {i}", "s": time.perf_counter() - t, "ranks": ranks})
    finally:
        remote.teardown()
    print(f"load {load:.1f} -> {os.getloadavg()[0]:.1f}, {args.procs} ranks, 1 pod")
    print(f"{'round':<12} {'call s':>7} {'rank PSS MB':>12} {'zygote PSS MB':>14} zygote has torch")
    for r in rows:
        pss = statistics.mean(x["pss_kb"] for x in r["ranks"]) / 1024
        zyg = statistics.mean(x["zygote_pss_kb"] for x in r["ranks"]) / 1024
        has = all(x["zygote_has_torch"] for x in r["ranks"])
        print(f"{r['round']:<12} {r['s']:>7.2f} {pss:>12.0f} {zyg:>14.0f} {has}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
