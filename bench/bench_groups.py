"""Worker-group benchmark (issue 10): ktlite beside Ray and Monarch, as ratios.

    python bench/bench_groups.py --peer-python /work/benchvenv/bin/python
    python bench/bench_groups.py --quick --skip-peers      # ktlite only, fewer iterations
    python bench/bench_groups.py --json out.json

Rows (see bench/README.md for the method):

- a single call, p50, on a single-rank deployment (no-op);
- a fan-out call to 4 and to 8 ranks, p50 (one pod with 4 / 8 rank processes; no-op);
- 100 calls submitted at once to a concurrency-8 single-rank deployment, calls/s: a no-op,
  and a 10 ms sleep (where running calls side by side shows);
- a per-rank-data call: 8 ranks, each given its own 1 MB, p50.

The systems take turns round by round on each row (``_rounds.py``: every round runs each
once, the order rotated between rounds), so that each system's samples come from the same
stretch of time as its peers'; the load average is recorded before and after every round.
The peers run in processes of their own (``bench/_group_peers.py``), up for the whole run, by
default with this Python, or with ``--peer-python`` (a venv holding ``torch``,
``ray[default]`` and ``torchmonarch``: the ``bench`` extra). It uses a private KTLITE_HOME
and tears down what it deploys.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-groups-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests' deployments
os.environ.pop("KTLITE_BACKEND", None)
sys.path.insert(0, str(HERE))

from _peer_link import PeerProcess  # noqa: E402
from _rounds import LoadLog, clock, run_rounds, timed_calls  # noqa: E402

import ktlite as kt  # noqa: E402

SUBMIT = 100
CONCURRENCY = 8
SLEEP_S = 0.010
PERRANK = 8
PERRANK_BYTES = 1_000_000
PEERS = ("ray", "monarch")
ASK_TIMEOUT = 300.0  # one round of one row on a peer; minutes on the busiest machine seen


# ---- what runs remotely (defined in __main__: shipped by value) ------------------------------


def noop() -> None:
    return None


def nap() -> None:
    time.sleep(SLEEP_S)


def take(data: bytes) -> int:
    return len(data)


# ---- measuring -------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def p50(samples: list[float]) -> float:
    s = sorted(samples)
    return s[max(0, math.ceil(len(s) / 2) - 1)]  # nearest rank


def one_rank(**changes: Any) -> kt.Compute:
    """A fresh Compute for each row: ``distribute()`` changes the Compute it is called on."""
    return kt.Compute(cpus=1, memory="1Gi", stream_logs=False, **changes)


def batch_seconds(remote: Any) -> Callable[[], float]:
    """Wall seconds of one batch of SUBMIT ``remote.submit()`` futures, after a warm-up batch."""

    def batch() -> None:
        for f in [remote.submit() for _ in range(SUBMIT)]:
            f.result(timeout=120)

    def timed() -> float:
        batch()
        t = clock()
        batch()
        return clock() - t

    return timed


class Bench:
    def __init__(self, quick: bool) -> None:
        self.rounds = 3 if quick else 5
        self.iters = 50 if quick else 200  # latency samples per system and row, over all rounds
        self.warmup = (
            10 if quick else 20
        )  # before a system's first round of a row; later rounds: a quarter
        self.m: dict[str, Any] = {}  # metric -> seconds (p50 or median batch)
        self.samples: dict[str, list[float]] = defaultdict(list)  # "system_row" -> every sample
        self.notes: list[str] = []
        self.remotes: list[Any] = []
        self.peers: dict[str, PeerProcess] = {}
        self.load = LoadLog()

    def per_round(self, total: int) -> int:
        return math.ceil(total / self.rounds)

    def warm(self, r: int, warmup: int | None = None) -> int:
        warmup = self.warmup if warmup is None else warmup
        return warmup if r == 0 else max(2, warmup // 4)

    def deploy(self, fn: Any, compute: kt.Compute, name: str) -> Any:
        remote = kt.fn(fn, name=name).to(compute)
        self.remotes.append(remote)
        return remote.options(stream_logs=False)

    def close(self) -> None:
        for remote in self.remotes:
            with contextlib.suppress(Exception):
                remote.teardown()
        self.remotes.clear()

    def start_peers(self, python: str) -> None:
        for engine in PEERS:
            log(f"{engine}: starting its runtime and actors (with {python})")
            cmd = [
                python,
                str(HERE / "_group_peers.py"),
                engine,
                "--fanout",
                "4",
                "8",
                "--concurrency",
                str(CONCURRENCY),
                "--perrank",
                str(PERRANK),
                "--perrank-bytes",
                str(PERRANK_BYTES),
            ]
            try:
                with self.load.step(f"{engine}: start"):
                    peer = PeerProcess(
                        engine, cmd, start_timeout=ASK_TIMEOUT, env={**os.environ, "TMPDIR": _HOME}
                    )
            except Exception as e:  # noqa: BLE001 - the other systems' rows still run
                self.notes.append(
                    f"{engine} did not start, its columns are empty: {type(e).__name__}: {e}"
                )
                log(f"{engine} FAILED to start: {e}")
                continue
            self.peers[engine] = peer
            self.m[f"{engine}_version"] = peer.ready["version"]

    def stop_peers(self) -> None:
        for peer in self.peers.values():
            with contextlib.suppress(Exception):
                peer.close()
        self.peers.clear()

    # ---- one row: ktlite's deployment, then the rounds -------------------------------------

    def row(
        self,
        key: str,
        setup: Callable[[], Callable[[int], list[float]]],
        ask: Callable[[PeerProcess, int], list[float]],
    ) -> None:
        """``setup()`` deploys ktlite's side and returns its round; every system then runs
        ``self.rounds`` rounds of this row in turn, and ktlite's deployment is torn down."""
        systems: dict[str, Callable[[int], None]] = {}
        try:
            kt_round = setup()
            systems["kt"] = lambda r: self.samples[f"kt_{key}"].extend(kt_round(r))
        except Exception as e:  # noqa: BLE001 - the peers' rounds still run
            self.notes.append(f"ktlite {key} failed before its rounds: {type(e).__name__}: {e}")
            log(f"ktlite {key} FAILED: {type(e).__name__}: {e}")
        for engine, peer in self.peers.items():
            systems[engine] = lambda r, e=engine, p=peer: self.samples[f"{e}_{key}"].extend(
                ask(p, r)
            )

        def failed(system: str, e: BaseException) -> None:
            self.samples.pop(f"{system}_{key}", None)  # a row with rounds missing is no row
            self.notes.append(f"{system} {key} failed: {type(e).__name__}: {e}")
            log(f"{system} {key} FAILED: {type(e).__name__}: {e}")

        try:
            run_rounds(key, systems, self.rounds, self.load, failed)
        finally:
            self.close()  # idle rank processes would only compete with the next row

    def latency_row(
        self, key: str, fn: Any, compute: kt.Compute, expect: Any, op: str, **kw: Any
    ) -> None:
        n = self.per_round(self.iters)

        def setup() -> Callable[[int], list[float]]:
            call = self.deploy(fn, compute, f"bg-{key.replace('_', '-')}")
            if call() != expect:
                raise RuntimeError(f"the {key} deployment did not return {expect!r}")
            return lambda r: timed_calls(call, n, self.warm(r))

        self.row(
            key,
            setup,
            lambda peer, r: peer.ask(op, ASK_TIMEOUT, iters=n, warmup=self.warm(r), **kw),
        )

    def single(self) -> None:
        self.latency_row("single", noop, one_rank(), None, "single")

    def fanout(self) -> None:
        for n in (4, 8):
            self.latency_row(
                f"fanout_{n}",
                noop,
                one_rank().distribute("spmd", workers=1, num_proc=n),
                [None] * n,
                "fanout",
                n=n,
            )

    def submit(self) -> None:
        for fn in (noop, nap):

            def setup(fn: Any = fn) -> Callable[[int], list[float]]:
                remote = kt.fn(fn, name=f"bg-submit-{fn.__name__}").to(
                    one_rank(concurrency=CONCURRENCY)
                )
                self.remotes.append(remote)
                timed = batch_seconds(remote.options(stream_logs=False))
                return lambda r: [timed()]

            self.row(
                f"submit_{fn.__name__}",
                setup,
                lambda peer, r, m=fn.__name__: [
                    peer.ask("submit", ASK_TIMEOUT, method=m, n=SUBMIT)
                ],
            )

    def perrank(self) -> None:
        n, warmup = self.per_round(max(10, self.iters // 4)), max(3, self.warmup // 4)
        shards = [os.urandom(PERRANK_BYTES) for _ in range(PERRANK)]

        def setup() -> Callable[[int], list[float]]:
            self.deploy(
                take, one_rank().distribute("spmd", workers=1, num_proc=PERRANK), "bg-perrank"
            )
            call = self.remotes[-1]  # each() is the handle's own (its Compute streams no logs)
            if call.each(shards) != [PERRANK_BYTES] * PERRANK:
                raise RuntimeError("remote.each did not give each rank its own 1 MB")
            return lambda r: timed_calls(lambda: call.each(shards), n, self.warm(r, warmup))

        self.row(
            "perrank",
            setup,
            lambda peer, r: peer.ask("perrank", ASK_TIMEOUT, iters=n, warmup=self.warm(r, warmup)),
        )

    def summarize(self) -> None:
        for key, samples in self.samples.items():
            if samples:
                self.m[key] = statistics.median(samples) if "_submit_" in key else p50(samples)

    # ---- the table -----------------------------------------------------------------------

    def table(self) -> list[list[str]]:
        rows = []
        spec = [
            ("single call p50, 1 rank (no-op)", "single", "time"),
            ("fan-out call p50, 4 ranks (no-op)", "fanout_4", "time"),
            ("fan-out call p50, 8 ranks (no-op)", "fanout_8", "time"),
            (f"{SUBMIT} submitted calls, concurrency {CONCURRENCY}, no-op", "submit_noop", "rate"),
            (
                f"{SUBMIT} submitted calls, concurrency {CONCURRENCY}, 10 ms sleep",
                "submit_nap",
                "rate",
            ),
            (f"per-rank data p50, {PERRANK} ranks x 1 MB", "perrank", "time"),
        ]
        for what, key, kind in spec:
            kv = self.m.get(f"kt_{key}")
            row = [what, _fmt(kv, kind)]
            for engine in PEERS:
                pv = self.m.get(f"{engine}_{key}")
                row += [_fmt(pv, kind), "-" if kv is None or pv is None else f"{kv / pv:.2f}"]
            rows.append(row)
        return rows

    def targets(self) -> list[str]:
        """Issue 26's targets on these rows, each met or not (with what is measured)."""
        out = []
        for what, key, peer, cause in (
            (
                f"{SUBMIT} submitted calls (concurrency {CONCURRENCY}) >= Ray's rate",
                "submit_noop",
                "ray",
                "a call is still ~0.75 M instructions over three processes (caller, pod server, "
                "rank: bench_cpu.py --rows submit), a wake-up at each hop between them, where "
                "Ray's stays in its C++ core worker; under load each wake-up waits for a CPU",
            ),
            (
                f"per-rank data {PERRANK} x 1 MB <= Monarch's time",
                "perrank",
                "monarch",
                "one shared-memory file per call and its rank's hand-off",
            ),
        ):
            kv, pv = self.m.get(f"kt_{key}"), self.m.get(f"{peer}_{key}")
            if kv is None or pv is None:
                out.append(f"{what}: not measured (a system's row failed)")
                continue
            ratio = kv / pv
            verdict = "met" if ratio <= 1.0 else f"not met ({cause})"
            out.append(f"{what}: {ratio:.2f}x {peer}'s time: {verdict}")
        return out


def _fmt(seconds: float | None, kind: str) -> str:
    if seconds is None:
        return "-"
    if kind == "rate":
        return f"{SUBMIT / seconds:,.0f}/s"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def render(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        ),
        "  ".join("-" * w for w in widths),
    ]
    out += [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer rounds and iterations (a smoke run, noisier numbers)",
    )
    p.add_argument(
        "--peer-python",
        default=sys.executable,
        metavar="PATH",
        help="the Python that runs the Ray and Monarch rows (a venv with the bench extra)",
    )
    p.add_argument("--skip-peers", action="store_true", help="ktlite rows only")
    p.add_argument("--json", metavar="PATH", help="also write every measurement to PATH")
    args = p.parse_args()

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # runs the cleanup below

    signal.signal(signal.SIGTERM, on_term)

    bench = Bench(args.quick)
    started = clock()
    try:
        if not args.skip_peers:
            bench.start_peers(args.peer_python)
        for step in (bench.single, bench.fanout, bench.submit, bench.perrank):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - one broken row must not hide the others
                bench.notes.append(f"{step.__name__} failed: {type(e).__name__}: {e}")
                log(f"{step.__name__} FAILED: {type(e).__name__}: {e}")
    finally:
        bench.close()
        bench.stop_peers()
        shutil.rmtree(_HOME, ignore_errors=True)
    bench.summarize()

    versions = ", ".join(
        f"{e} {bench.m[f'{e}_version']}" for e in PEERS if f"{e}_version" in bench.m
    )
    print(
        f"\nktlite {kt.__version__} worker-group benchmark{' (--quick)' if args.quick else ''}: "
        f"Python {platform.python_version()}, {os.cpu_count()} CPU(s), {clock() - started:.0f} s"
        f"{'; ' + versions if versions else ''}; systems interleaved, {bench.rounds} rounds per row (order "
        f"rotated); latencies p50 of {bench.per_round(bench.iters) * bench.rounds} calls "
        f"({bench.per_round(max(10, bench.iters // 4)) * bench.rounds} for per-rank data), throughput median "
        f"of {bench.rounds} batches"
    )
    print(bench.load.summary())
    print(
        "ratio = ktlite time / peer time (for calls/s: peer rate / ktlite rate): below 1, ktlite is faster\n"
    )
    print(render(bench.table(), ["measurement", "ktlite", "Ray", "ratio", "Monarch", "ratio"]))
    print("\nissue 26's targets (ratio: ktlite's time / the peer's, in this run):")
    for line in bench.targets():
        print(f"- {line}")
    print("\nload average (1 min) before -> after each round:")
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
                    "ktlite": kt.__version__,
                    "metrics": bench.m,
                    "samples": bench.samples,
                    "load": bench.load.as_json(),
                    "notes": bench.notes,
                },
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
