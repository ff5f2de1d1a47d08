"""ktlite against itself: two source trees, "before" and "after", in one run, as ratios.

    python bench/bench_ab.py --before-python /tmp/before/.venv/bin/python \\
                             --after-python .venv/bin/python [--quick] [--json out.json]

Each tree runs in a process of its own, with its own Python (a venv holding that tree in
editable mode), its own ``KTLITE_HOME`` and its own deployment names, so the two never share
a pod; ``bench/_ab_driver.py`` (public ``kt.*`` API only, the same file for both trees) is
asked for one round at a time over ``_peer_link``. Every row runs round by round
(``_rounds.run_rounds``: each round runs both trees once, the order rotated), so both see
the same stretch of the machine's load; the load average is recorded around every round.

Rows (the hot paths of a call; see bench/README.md, "Before and after"):

- warm call p50/p99, 1 pod, no-op, ``stream_logs=False``;
- fan-out p50/p99 to 4 pods (``workers=4``), to 8 pods (``workers=8``) and to 8 ranks on 4 pods
  (``workers=4, num_proc=2``);
- 100 calls submitted at once (``.submit()`` futures) to one pod with ``concurrency=8``, calls/s;
- per-rank data p50/p99: 8 ranks (``workers=4, num_proc=2``) x 1 MB each, ``kt.per_rank``;
- a 100 MB argument and a 100 MB result (a float32 numpy array when both Pythons have numpy,
  else bytes), MB/s;
- for scale, one sample each: ``.to()`` of every deployment above (cold, fresh name).

The ratio is after / before: for times, below 1 is faster; for rates, above 1 is faster.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _bench_report as report  # noqa: E402
from _peer_link import PeerProcess  # noqa: E402
from _rounds import LoadLog, clock, run_rounds  # noqa: E402

SIDES = ("before", "after")
START_TIMEOUT = 300.0  # a driver's `import ktlite`, on the busiest machine seen
DEPLOY_TIMEOUT = 900.0  # one .to() of up to 8 pods
ASK_TIMEOUT = 600.0  # one round of one deployment's rows


@dataclass(frozen=True)
class Row:
    key: str  # in the samples and the JSON
    op: str  # the driver's row (``_ab_driver.ROWS``)
    label: str


@dataclass(frozen=True)
class Shape:
    """One deployment per side, and the rows measured on it in the same rounds."""

    key: str
    workers: int
    num_proc: int
    rows: tuple[Row, ...]
    concurrency: int | None = None

    @property
    def label(self) -> str:
        pods = f"{self.workers} pod{'s' if self.workers > 1 else ''}"
        ranks = f" x {self.num_proc} ranks" if self.num_proc > 1 else ""
        c = f", concurrency {self.concurrency}" if self.concurrency else ""
        return f"{self.key}: {pods}{ranks}{c}"


SHAPES = (
    Shape("warm", 1, 1, (Row("warm_call", "call", "warm call, 1 pod, no-op"),)),
    Shape("fanout4", 4, 1, (Row("fanout_4x1", "call", "fan-out to 4 pods (workers=4)"),)),
    Shape("fanout8", 8, 1, (Row("fanout_8x1", "call", "fan-out to 8 pods (workers=8)"),)),
    Shape(
        "fanout4x2",
        4,
        2,
        (
            Row("fanout_4x2", "call", "fan-out to 8 ranks (workers=4, num_proc=2)"),
            Row("perrank", "perrank", "per-rank data, 8 ranks (4x2) x 1 MB"),
        ),
    ),
    Shape("submit", 1, 1, (Row("submit", "submit", "100 submitted calls, concurrency 8"),), 8),
    Shape(
        "xfer",
        1,
        1,
        (Row("xfer_arg", "arg", "100 MB argument"), Row("xfer_result", "result", "100 MB result")),
    ),
)
Stat = Callable[[list[float]], float]
RATES = {"submit": "calls/s", "xfer_arg": "MB/s", "xfer_result": "MB/s"}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def driver_env(home: str) -> dict[str, str]:
    """This environment without what would make a driver import another tree's ktlite or reuse
    another KTLITE_HOME."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KTLITE_") and k not in ("PYTHONPATH", "PYTHONHOME")
    }
    env["KTLITE_HOME"] = home
    return env


class Bench:
    def __init__(self, quick: bool) -> None:
        self.rounds = 3 if quick else 5
        self.iters = 60 if quick else 300  # samples of each call row and side, over all rounds
        self.warmup = 10 if quick else 30  # in a side's first round of a row; later: a quarter
        self.perrank_iters = 30 if quick else 100
        self.batches = 1 if quick else 2  # per round: submit batches, 100 MB transfers
        self.peers: dict[str, PeerProcess] = {}
        self.ready: dict[str, Any] = {}
        # side -> row -> one list of samples per round
        self.samples: dict[str, dict[str, list[list[float]]]] = {
            s: defaultdict(list) for s in SIDES
        }
        self.to_s: dict[str, dict[str, float]] = {s: {} for s in SIDES}
        self.rank_modules: dict[str, dict[str, Any]] = {}
        self.notes: list[str] = []
        self.load = LoadLog()
        self.homes: list[str] = []
        self.kind = "bytes"
        self.failures = 0

    def warm(self, r: int) -> int:
        return self.warmup if r == 0 else max(2, self.warmup // 4)

    def counts(self, row: Row, r: int) -> tuple[int, int]:
        """(samples, warm-up calls) of one round of ``row``; for the rates, the warm-up is a flag."""
        if row.op == "call":
            return math.ceil(self.iters / self.rounds), self.warm(r)
        if row.op == "perrank":
            return math.ceil(self.perrank_iters / self.rounds), max(2, self.warm(r) // 2)
        return self.batches, int(r == 0)

    # ---- the two drivers -------------------------------------------------------------------

    def start(self, pythons: dict[str, str]) -> None:
        for side in SIDES:
            home = tempfile.mkdtemp(prefix=f"ktlite-ab-{side}-")
            self.homes.append(home)
            log(f"{side}: starting the driver with {pythons[side]}")
            with self.load.step(f"{side}: driver start"):
                peer = PeerProcess(
                    side,
                    [pythons[side], str(HERE / "_ab_driver.py")],
                    START_TIMEOUT,
                    env=driver_env(home),
                    cwd=home,  # no source tree on sys.path but the venv's own
                )
            self.peers[side], self.ready[side] = peer, peer.ready
        dirs = {side: self.ready[side]["ktlite_dir"] for side in SIDES}
        if dirs["before"] == dirs["after"]:
            self.notes.append(
                f"both sides import ktlite from {dirs['after']}: the ratios measure noise only"
            )
        if all(self.ready[s]["numpy"] for s in SIDES):
            self.kind = "numpy"
        else:
            self.notes.append("numpy is missing on a side: the 100 MB rows send bytes")

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        for home in self.homes:
            shutil.rmtree(home, ignore_errors=True)

    def check_ranks(self, side: str, modules: dict[str, Any]) -> None:
        """The rank's ktlite packages must come from the side's own tree."""
        root = os.path.dirname(self.ready[side]["ktlite_dir"])
        self.rank_modules.setdefault(side, modules)
        stray = {n: f for n, f in modules.items() if f and not f.startswith(root + os.sep)}
        if stray:
            raise RuntimeError(f"{side}: its ranks imported {stray}, outside its tree {root}")

    # ---- one deployment shape --------------------------------------------------------------

    def shape(self, index: int, shape: Shape) -> None:
        order = SIDES if index % 2 == 0 else SIDES[::-1]
        up: list[str] = []
        try:
            for side in order:
                log(f"{side}: deploying {shape.label}")
                try:
                    with self.load.step(f"{shape.key}: {side} .to()"):
                        got = self.peers[side].ask(
                            "deploy",
                            DEPLOY_TIMEOUT,
                            key=shape.key,
                            name=f"ab-{side}-{shape.key}-{os.getpid()}",
                            workers=shape.workers,
                            num_proc=shape.num_proc,
                            concurrency=shape.concurrency,
                        )
                    up.append(side)
                    self.to_s[side][shape.key] = got["to_s"]
                    self.check_ranks(side, got["rank_modules"])
                except Exception as e:  # noqa: BLE001 - the other side's rows still run
                    self.failed(shape.key, side, e)
            systems = {side: self.round_of(side, shape) for side in SIDES if side in up}
            run_rounds(
                shape.key,
                systems,
                self.rounds,
                self.load,
                lambda side, e: self.failed(shape.key, side, e),
            )
        finally:
            for side in up:
                try:
                    self.peers[side].ask("teardown", DEPLOY_TIMEOUT, key=shape.key)
                except Exception as e:  # noqa: BLE001 - the next shapes still run
                    self.failed(f"{shape.key} teardown", side, e)

    def round_of(self, side: str, shape: Shape) -> Callable[[int], None]:
        def one(r: int) -> None:
            for row in shape.rows:
                n, warmup = self.counts(row, r)
                got = self.peers[side].ask(
                    "measure",
                    ASK_TIMEOUT,
                    key=shape.key,
                    row=row.op,
                    n=n,
                    warmup=warmup,
                    kind=self.kind,
                )
                self.samples[side][row.key].append(got)

        return one

    def failed(self, what: str, side: str, e: BaseException) -> None:
        self.failures += 1
        self.notes.append(f"{what}: {side} failed: {type(e).__name__}: {e}")
        log(f"{what}: {side} FAILED: {type(e).__name__}: {e}")


# ---- the report ------------------------------------------------------------------------------


def fmt_rate(v: float | None, unit: str) -> str:
    return "-" if v is None else f"{v:,.0f} {unit}"


def change(before: float | None, after: float | None, rate: bool) -> tuple[str, str]:
    """(after / before; in words, the factor by which after is faster or slower, or "same")."""
    if before is None or after is None or before <= 0 or after <= 0:
        return "-", "-"
    ratio = after / before
    better = ratio > 1 if rate else ratio < 1
    factor = max(ratio, 1 / ratio)
    if factor < 1.005:
        return f"{ratio:.2f}", "same"
    return f"{ratio:.2f}", f"{factor:.2f}x {'faster' if better else 'slower'}"


def p50(samples: list[float]) -> float:
    return report.percentile(samples, 50)


def p99(samples: list[float]) -> float:
    return report.percentile(samples, 99)


def spread(before: list[list[float]], after: list[list[float]], f: Stat) -> str:
    """The lowest and highest after / before of ``f`` over the rounds both sides ran."""
    # a side left out after a failure ran fewer rounds: compare the rounds both ran
    pairs = zip(before, after, strict=False)
    ratios = [f(a) / f(b) for b, a in pairs if a and b and f(b) > 0]
    return "-" if not ratios else f"{min(ratios):.2f}-{max(ratios):.2f}"


def table(
    shapes: list[Shape],
    samples: dict[str, dict[str, list[list[float]]]],
    to_s: dict[str, dict[str, float]],
) -> list[list[str]]:
    """One line per row of ``shapes`` and statistic: measurement, before, after, after / before,
    in words, and for p50s and medians the range of that ratio over the rounds; "-" where a
    side has no sample."""
    out: list[list[str]] = []

    def line(what: str, b: float | None, a: float | None, unit: str | None, rounds: str) -> None:
        if unit is None:
            cells = [report.fmt_time(b), report.fmt_time(a)]
        else:
            cells = [fmt_rate(b, unit), fmt_rate(a, unit)]
        out.append([what, *cells, *change(b, a, unit is not None), rounds])

    def measured(what: str, key: str, f: Stat, unit: str | None, per_round: bool) -> None:
        rounds = {side: samples[side].get(key, []) for side in SIDES}
        b, a = (f(flat) if flat else None for flat in (sum(rounds[s], []) for s in SIDES))
        line(what, b, a, unit, spread(rounds["before"], rounds["after"], f) if per_round else "")

    for shape in shapes:
        for row in shape.rows:
            if row.key in RATES:
                measured(f"{row.label}, median", row.key, statistics.median, RATES[row.key], True)
            else:
                measured(f"{row.label}, p50", row.key, p50, None, True)
                measured(f"{row.label}, p99", row.key, p99, None, False)
    for shape in shapes:
        b, a = to_s["before"].get(shape.key), to_s["after"].get(shape.key)
        if b is not None or a is not None:
            line(f"cold .to() ({shape.label}), 1 sample", b, a, None, "")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--before-python", required=True, help="Python of the venv holding the 'before' tree"
    )
    p.add_argument(
        "--after-python", required=True, help="Python of the venv holding the 'after' tree"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer rounds and samples (about 2 minutes on a quiet machine)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every sample to PATH")
    p.add_argument(
        "--only",
        metavar="SHAPES",
        help=f"comma-separated deployments to measure (default all: {','.join(s.key for s in SHAPES)})",
    )
    args = p.parse_args()
    pythons = {}
    for side in SIDES:
        # absolute (the drivers run in another directory), but not resolved: a venv's python is
        # a link, and resolving it would leave the venv
        python = os.path.abspath(getattr(args, f"{side}_python"))
        if not os.access(python, os.X_OK):
            p.error(
                f"--{side}-python {python}: no such executable (a venv's bin/python is expected)"
            )
        pythons[side] = python
    shapes = list(SHAPES)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = sorted(set(wanted) - {s.key for s in SHAPES})
        if unknown:
            p.error(
                f"--only: unknown {', '.join(unknown)}; choose from {', '.join(s.key for s in SHAPES)}"
            )
        shapes = [s for s in SHAPES if s.key in wanted]

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    bench = Bench(args.quick)
    started = clock()
    try:
        bench.start(pythons)
        for i, shape in enumerate(shapes):
            bench.shape(i, shape)
    finally:
        bench.close()

    rows = table(shapes, bench.samples, bench.to_s)
    print(
        f"\nktlite before/after{' (--quick)' if args.quick else ''}: {os.cpu_count()} CPU(s), "
        f"{platform.machine()}, {clock() - started:.0f} s; call rows over {bench.iters} calls per side "
        f"in {bench.rounds} rounds (after {bench.warmup} warm-up calls, {bench.warm(1)} in later rounds), "
        f"per-rank over {bench.perrank_iters}, rates median of {bench.batches * bench.rounds}; "
        f"100 MB as {bench.kind}; MB = 10^6 bytes; both sides interleaved round by round, order rotated"
    )
    for side in SIDES:
        ready = bench.ready.get(side)
        if ready:
            print(
                f"{side}: ktlite {ready['ktlite']} from {ready['ktlite_dir']}, Python {ready['python']} "
                f"({ready['executable']})"
            )
    print(bench.load.summary())
    print(
        "ratio = after / before: for times below 1 is faster, for rates above 1 is faster; "
        "per round: the lowest and highest ratio of one round's p50s (medians)\n"
    )
    header = ["measurement", "before", "after", "after/before", "after is", "per round"]
    print(report.render(rows, header, left=(0,)))
    print("\nload average (1 min) before -> after each round or step:")
    for line in bench.load.lines():
        print(f"  {line}")
    if bench.notes:
        print("\nnotes:")
        for n in bench.notes:
            print(f"- {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "quick": args.quick,
                    "cpus": os.cpu_count(),
                    "sides": bench.ready,
                    "rank_modules": bench.rank_modules,
                    "kind": bench.kind,
                    "samples": {s: dict(v) for s, v in bench.samples.items()},
                    "to_s": bench.to_s,
                    "table": rows,
                    "load": bench.load.as_json(),
                    "notes": bench.notes,
                },
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
