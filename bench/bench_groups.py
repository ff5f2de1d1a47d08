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

The peers run in their own processes (``bench/_group_peers.py``), by default with this
Python, or with ``--peer-python`` (a venv holding ``torch``, ``ray[default]`` and
``torchmonarch``: the ``bench`` extra). It uses a private KTLITE_HOME and tears down what it
deploys.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-groups-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests' deployments
os.environ.pop("KTLITE_BACKEND", None)

import ktlite as kt  # noqa: E402

clock = time.perf_counter
SUBMIT = 100
CONCURRENCY = 8
SLEEP_S = 0.010
PERRANK = 8
PERRANK_BYTES = 1_000_000
PEERS = ("ray", "monarch")


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


def loop(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    gc.collect()
    out = []
    for _ in range(iters):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def rounds(fn: Callable[[], Any], n: int) -> list[float]:
    fn()
    out = []
    for _ in range(n):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def _with_concurrency(compute: kt.Compute, k: int) -> tuple[kt.Compute, bool]:
    """``Compute(concurrency=k)`` where this ktlite has it (issue 10's concurrency work)."""
    try:
        return kt.Compute(**{**_fields(compute), "concurrency": k}), True
    except TypeError:
        return compute, False


def _batch(remote: Any) -> tuple[Callable[[], None], str]:
    """One batch of SUBMIT calls in flight at once: through ``remote.submit`` (futures) where
    this ktlite has it, else from CONCURRENCY threads each calling the deployment."""
    call = remote.options(stream_logs=False)
    target = call if hasattr(call, "submit") else remote
    if hasattr(target, "submit"):
        def by_futures() -> None:
            futures = [target.submit() for _ in range(SUBMIT)]
            for f in futures:
                f.result(timeout=120)
        return by_futures, "remote.submit"
    pool = concurrent.futures.ThreadPoolExecutor(CONCURRENCY)

    def by_threads() -> None:
        for f in [pool.submit(call) for _ in range(SUBMIT)]:
            f.result(timeout=120)
    return by_threads, f"{CONCURRENCY} threads calling the deployment"


def _fields(compute: kt.Compute) -> dict[str, Any]:
    return {"cpus": compute.cpus, "memory": compute.memory, "stream_logs": compute.stream_logs}


class Bench:
    def __init__(self, quick: bool) -> None:
        self.iters = 50 if quick else 200
        self.warmup = 10 if quick else 20
        self.rounds = 2 if quick else 5
        self.m: dict[str, Any] = {}  # metric -> seconds (p50 or median batch)
        self.notes: list[str] = []
        self.remotes: list[Any] = []
        self.base = kt.Compute(cpus=1, memory="1Gi", stream_logs=False)

    def deploy(self, fn: Any, compute: kt.Compute, name: str) -> Any:
        remote = kt.fn(fn, name=name).to(compute)
        self.remotes.append(remote)
        return remote.options(stream_logs=False)

    def close(self) -> None:
        for remote in self.remotes:
            with contextlib.suppress(Exception):
                remote.teardown()
        self.remotes.clear()

    # ---- ktlite rows ---------------------------------------------------------------------

    def single(self) -> None:
        log(f"ktlite single call, 1 rank: {self.iters} calls")
        call = self.deploy(noop, self.base, "bg-single")
        self.m["kt_single"] = p50(loop(call, self.iters, self.warmup))

    def fanout(self) -> None:
        for n in (4, 8):
            log(f"ktlite fan-out to {n} ranks (1 pod x {n}): {self.iters} calls")
            call = self.deploy(noop, self.base.distribute("spmd", workers=1, num_proc=n), f"bg-fanout-{n}")
            if call() != [None] * n:
                raise RuntimeError(f"the {n}-rank call did not return {n} results")
            self.m[f"kt_fanout_{n}"] = p50(loop(call, self.iters, self.warmup))
            self.close()  # 8 idle rank processes would only compete with the next row

    def submit(self) -> None:
        compute, explicit = _with_concurrency(self.base, CONCURRENCY)
        if not explicit:
            self.notes.append("this ktlite has no Compute(concurrency=...): the submit rows ran on "
                              "its default concurrency")
        for fn in (noop, nap):
            remote = kt.fn(fn, name=f"bg-submit-{fn.__name__}").to(compute)
            self.remotes.append(remote)
            batch, how = _batch(remote)
            log(f"ktlite {SUBMIT} calls of {fn.__name__} at once via {how}: {self.rounds} rounds")
            self.m[f"kt_submit_{fn.__name__}"] = statistics.median(rounds(batch, self.rounds))
            self.m["kt_submit_how"] = how
            self.close()

    def perrank(self) -> None:
        call = self.deploy(take, self.base.distribute("spmd", workers=1, num_proc=PERRANK), "bg-perrank")
        if not hasattr(call, "each"):
            call = self.remotes[-1]
        if not hasattr(call, "each"):
            self.notes.append("per-rank data: this ktlite has no remote.each(...) yet; row skipped")
            self.close()
            return
        shards = [os.urandom(PERRANK_BYTES) for _ in range(PERRANK)]
        if call.each(shards) != [PERRANK_BYTES] * PERRANK:
            raise RuntimeError("remote.each did not give each rank its own 1 MB")
        iters, warm = max(10, self.iters // 4), max(3, self.warmup // 4)
        log(f"ktlite per-rank data, {PERRANK} ranks x 1 MB: {iters} calls")
        self.m["kt_perrank"] = p50(loop(lambda: call.each(shards), iters, warm))
        self.close()

    # ---- peers ---------------------------------------------------------------------------

    def peer(self, engine: str, python: str) -> None:
        out = Path(_HOME) / f"{engine}.json"
        cmd = [python, str(HERE / "_group_peers.py"), engine, "--out", str(out), "--iters", str(self.iters),
               "--warmup", str(self.warmup), "--rounds", str(self.rounds), "--submit", str(SUBMIT),
               "--concurrency", str(CONCURRENCY), "--perrank", str(PERRANK),
               "--perrank-bytes", str(PERRANK_BYTES)]
        log(f"{engine}: {' '.join(cmd[1:3])} (with {python})")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "TMPDIR": _HOME})
        try:
            text, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            raise RuntimeError(f"{engine} peer ran past 600 s") from None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever its runtime left behind
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join(text.strip().splitlines()[-3:])
            raise RuntimeError(f"{engine} peer exited with code {proc.returncode}: {tail}")
        data = json.loads(out.read_text())
        self.m[f"{engine}_version"] = data.pop("version")
        for key, samples in data.items():
            self.m[f"{engine}_{key}"] = statistics.median(samples) if key.startswith("submit") else p50(samples)

    # ---- the table -----------------------------------------------------------------------

    def table(self) -> list[list[str]]:
        rows = []
        spec = [("single call p50, 1 rank (no-op)", "single", "time"),
                ("fan-out call p50, 4 ranks (no-op)", "fanout_4", "time"),
                ("fan-out call p50, 8 ranks (no-op)", "fanout_8", "time"),
                (f"{SUBMIT} submitted calls, concurrency {CONCURRENCY}, no-op", "submit_noop", "rate"),
                (f"{SUBMIT} submitted calls, concurrency {CONCURRENCY}, 10 ms sleep", "submit_nap", "rate"),
                (f"per-rank data p50, {PERRANK} ranks x 1 MB", "perrank", "time")]
        for what, key, kind in spec:
            kv = self.m.get(f"kt_{key}")
            row = [what, _fmt(kv, kind)]
            for engine in PEERS:
                pv = self.m.get(f"{engine}_{key}")
                row += [_fmt(pv, kind), _ratio(kv, pv, kind)]
            rows.append(row)
        return rows


def _fmt(seconds: float | None, kind: str) -> str:
    if seconds is None:
        return "-"
    if kind == "rate":
        return f"{SUBMIT / seconds:,.0f}/s"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def _ratio(kv: float | None, pv: float | None, kind: str) -> str:
    """ktlite's time / the peer's (for calls/s: the peer's rate / ktlite's): below 1, ktlite is faster."""
    if kv is None or pv is None:
        return "-"
    return f"{kv / pv:.2f}"


def render(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run, noisier numbers)")
    p.add_argument("--peer-python", default=sys.executable, metavar="PATH",
                   help="the Python that runs the Ray and Monarch rows (a venv with the bench extra)")
    p.add_argument("--skip-peers", action="store_true", help="ktlite rows only")
    p.add_argument("--json", metavar="PATH", help="also write every measurement to PATH")
    args = p.parse_args()

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # runs the cleanup below

    signal.signal(signal.SIGTERM, on_term)

    bench = Bench(args.quick)
    started = clock()
    steps: list[tuple[str, Callable[[], None]]] = [
        ("single", bench.single), ("fanout", bench.fanout), ("submit", bench.submit),
        ("perrank", bench.perrank)]
    if not args.skip_peers:  # after ktlite is torn down: the runtimes never share a window
        steps += [(e, lambda e=e: bench.peer(e, args.peer_python)) for e in PEERS]
    try:
        for name, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - one broken row must not hide the others
                bench.notes.append(f"{name} failed: {type(e).__name__}: {e}")
                log(f"{name} FAILED: {type(e).__name__}: {e}")
            finally:
                bench.close()
    finally:
        bench.close()
        shutil.rmtree(_HOME, ignore_errors=True)

    versions = ", ".join(f"{e} {bench.m[f'{e}_version']}" for e in PEERS if f"{e}_version" in bench.m)
    print(f"\nktlite {kt.__version__} worker-group benchmark{' (--quick)' if args.quick else ''}: "
          f"Python {platform.python_version()}, {os.cpu_count()} CPU(s), {clock() - started:.0f} s"
          f"{'; ' + versions if versions else ''}; latencies p50 of {bench.iters} calls "
          f"({max(10, bench.iters // 4)} for per-rank data), throughput median of {bench.rounds} batches")
    print("ratio = ktlite time / peer time (for calls/s: peer rate / ktlite rate): below 1, ktlite is faster\n")
    print(render(bench.table(), ["measurement", "ktlite", "Ray", "ratio", "Monarch", "ratio"]))
    if "kt_submit_how" in bench.m:
        print(f"\nktlite's submitted calls went through {bench.m['kt_submit_how']}")
    if bench.notes:
        print("\nnotes:")
        for n in bench.notes:
            print(f"- {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"quick": args.quick, "ktlite": kt.__version__, "metrics": bench.m,
                       "notes": bench.notes}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
