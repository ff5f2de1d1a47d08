"""ktlite benchmark: ktlite's numbers side by side with its peers, as ratios (ktlite / peer).

    python bench/bench.py            # full run (several minutes)
    python bench/bench.py --quick    # fewer rounds and iterations, same measurements
    python bench/bench.py --json out.json

What it measures (see bench/README.md for the method):

- warm call round trip p50/p99: 1 worker, no-op, stream_logs=False; beside a raw
  FastAPI + httpx + cloudpickle round trip and Ray's actor call;
- warm distributed call with 2 and 4 ranks (2x1, 4x1, 2x2; spmd, no-op); beside Ray's
  fan-out to 2 and 4 actors;
- ``.to()`` cold start to first result (fresh name, 1 worker);
- cold ``.to()`` + first call of a 4-rank gloo all_reduce job (pytorch, 2x2) and a warm
  re-run of it; beside torchrun launching the same job;
- redeploy after a code change (same name, new function body, same compute);
- a 100 MB numpy array and a 100 MB torch tensor as argument and as result (MB/s);
  beside raw loopback TCP.

A row with peers runs them round by round with ktlite's side (``_rounds.py``: each round runs
every system once, the order rotated between rounds), so all see the same stretch of the
machine's load; the load average is recorded before and after every round and printed with
the table. Each row builds its own ``kt.Compute``: ``distribute()`` changes the Compute it is
called on. Everything it starts it stops. It uses a private KTLITE_HOME, so it never touches
the deployments of tests or of the user.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests' deployments
os.environ.pop("KTLITE_BACKEND", None)
sys.path.insert(0, str(HERE))

import _bench_report as report  # noqa: E402
from _bench_jobs import XFER_BYTES, array, noop, versioned, xfer  # noqa: E402
from _bench_peers import RawServer, loopback_tcp_mbps, run_timed, start_ray  # noqa: E402
from _rounds import LoadLog, clock, run_rounds, timed_calls  # noqa: E402
from _torchrun_job import allreduce_job  # noqa: E402

import ktlite as kt  # noqa: E402

MB = 1_000_000
HAVE_NUMPY = importlib.util.find_spec("numpy") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_RAY = importlib.util.find_spec("ray") is not None
ASK_TIMEOUT = 300.0  # one round of one row in the Ray peer; minutes on the busiest machine seen


# ---- helpers -----------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def one_pod(**changes: Any) -> kt.Compute:
    """A fresh Compute for each row: ``distribute()`` changes the Compute it is called on (as
    Kubetorch's does), so a shared base would carry one row's layout into the next rows."""
    return kt.Compute(**{"cpus": 1, "memory": "1Gi", "stream_logs": False, **changes})


class Bench:
    def __init__(self, quick: bool, ray: bool) -> None:
        self.quick = quick
        self.ray = ray
        self.rounds = 3 if quick else 5  # of the latency rows
        self.iters = 60 if quick else 300  # latency samples per system and row, over all rounds
        self.warmup = (
            10 if quick else 30
        )  # before a system's first round of a row; later rounds: a quarter
        self.reps = 1 if quick else 3  # cold starts; rounds of the gloo job against torchrun
        self.xfer_reps = 2 if quick else 3
        self.redeploys = 3 if quick else 6
        self.gloo_reruns = 3 if quick else 10
        self.m: dict[str, Any] = {}  # metric -> summary
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.notes: list[str] = []
        self.remotes: list[Any] = []
        self.load = LoadLog()

    def per_round(self) -> int:
        return math.ceil(self.iters / self.rounds)

    def warm(self, r: int) -> int:
        return self.warmup if r == 0 else max(2, self.warmup // 4)

    # ---- lifecycle -----------------------------------------------------------------------

    def deploy(self, fn: Any, compute: kt.Compute, name: str) -> Any:
        remote = kt.fn(fn, name=name).to(compute)
        self.remotes.append(remote)
        return remote

    def teardown(self, remote: Any) -> None:
        with contextlib.suppress(Exception):
            remote.teardown()
        with contextlib.suppress(ValueError):
            self.remotes.remove(remote)

    def close(self) -> None:
        for remote in list(self.remotes):
            self.teardown(remote)

    def in_rounds(
        self, what: str, systems: dict[str, Callable[[int], None]], rounds: int
    ) -> set[str]:
        """``run_rounds`` with failures noted; returns the systems that failed."""

        def failed(name: str, e: BaseException) -> None:
            self.notes.append(f"{what}: {name} failed: {type(e).__name__}: {e}")
            log(f"{what}: {name} FAILED: {type(e).__name__}: {e}")

        return run_rounds(what, systems, rounds, self.load, failed)

    # ---- warm calls: ktlite, the raw FastAPI floor and Ray, round by round -----------------

    def calls(self) -> None:
        raw, ray = None, None
        tmp = tempfile.mkdtemp(prefix="kb-ray-")
        try:
            with self.load.step("raw FastAPI server and Ray: start"):
                try:
                    raw = RawServer()
                    self.m["raw_server"] = raw.how
                except Exception as e:  # noqa: BLE001 - ktlite's rows still run
                    self.notes.append(f"raw FastAPI server: {type(e).__name__}: {e}")
                if not self.ray:
                    self.notes.append(
                        "Ray is not installed or --skip-ray: its rows are skipped "
                        "(pip install ray to compare)"
                    )
                else:
                    log("Ray (separate process): ray.init and 4 actors")
                    try:
                        ray = start_ray(tmp, 4, timeout=600)
                        self.m["ray_version"], self.m["ray_init_s"] = (
                            ray.ready["ray_version"],
                            ray.ready["init_s"],
                        )
                    except Exception as e:  # noqa: BLE001 - ktlite's rows still run
                        self.notes.append(
                            f"Ray peer did not start; its rows are skipped: {type(e).__name__}: {e}"
                        )
            n = self.per_round()
            peers: dict[str, Callable[[int], list[float]]] = {}
            if raw is not None:
                peers["raw_fastapi"] = lambda r: timed_calls(raw.call, n, self.warm(r))
            if ray is not None:
                peers["ray_actor_call"] = lambda r: ray.ask(
                    "actor_call", ASK_TIMEOUT, iters=n, warmup=self.warm(r)
                )
            self.call_row("kt_warm_call", one_pod(), None, peers)
            for workers, procs in ((2, 1), (4, 1), (2, 2)):
                shape = f"{workers}x{procs}"
                peers = (
                    {}
                    if ray is None
                    else {
                        f"ray_fanout_{shape}": lambda r, k=workers * procs: ray.ask(
                            "fanout", ASK_TIMEOUT, n=k, iters=n, warmup=self.warm(r)
                        )
                    }
                )
                self.call_row(
                    f"kt_dist_{shape}",
                    one_pod().distribute("spmd", workers=workers, num_proc=procs),
                    [None] * (workers * procs),
                    peers,
                )
        finally:
            for peer in (raw, ray):
                if peer is not None:
                    peer.close()
            shutil.rmtree(tmp, ignore_errors=True)

    def call_row(
        self,
        key: str,
        compute: kt.Compute,
        want: Any,
        peers: dict[str, Callable[[int], list[float]]],
    ) -> None:
        """ktlite's no-op on ``compute`` (its call returns ``want``) beside ``peers`` (name -> one
        round's samples), round by round."""
        systems: dict[str, Callable[[int], None]] = {}
        remote = None
        n = self.per_round()
        try:
            remote = self.deploy(noop, compute, f"bench-{key[3:].replace('_', '-')}")
            call = remote.options(stream_logs=False)
            if call() != want:
                raise RuntimeError(f"{key}: the no-op returned something else than {want!r}")
            systems[key] = lambda r: self.samples[key].extend(timed_calls(call, n, self.warm(r)))
        except Exception as e:  # noqa: BLE001 - the peers' rounds still run
            self.notes.append(f"{key} failed before its rounds: {type(e).__name__}: {e}")
        for name, peer in peers.items():
            systems[name] = lambda r, name=name, peer=peer: self.samples[name].extend(peer(r))
        try:
            failed = self.in_rounds(key, systems, self.rounds)
        finally:
            if remote is not None:
                self.teardown(remote)
        for name in systems:
            if name not in failed:
                self.m[name] = report.lat_summary(self.samples[name])

    # ---- ktlite alone --------------------------------------------------------------------

    def cold_start(self) -> None:
        log(f"ktlite cold .to() + first call, fresh name, 1 worker: {self.reps} time(s)")
        to_s, first_s, total = [], [], []
        for i in range(self.reps):
            with self.load.step(f"cold start {i + 1}/{self.reps}"):
                t0 = clock()
                remote = self.deploy(noop, one_pod(), f"bench-cold-{os.getpid()}-{i}")
                t1 = clock()
                remote()
                t2 = clock()
                self.teardown(remote)
            to_s.append(t1 - t0)
            first_s.append(t2 - t1)
            total.append(t2 - t0)
        self.m["kt_cold_to"] = report.reps_summary(to_s)
        self.m["kt_cold_first_call"] = report.reps_summary(first_s)
        self.m["kt_cold_total"] = report.reps_summary(total)

    def redeploy(self) -> None:
        log(f"ktlite redeploy after a code change: {self.redeploys} time(s)")
        compute = one_pod()  # the same Compute for every version: only the code changes
        remote = self.deploy(versioned(0), compute, "bench-redeploy")
        try:
            if remote() != 0:
                raise RuntimeError("the first version did not run")
            pids_before = [r["pid"] for pod in remote.status() for r in pod["ranks"]]
            to_s, first_s = [], []
            with self.load.step(f"redeploy x{self.redeploys}"):
                for v in range(1, self.redeploys + 1):
                    t0 = clock()
                    new = kt.fn(versioned(v), name="bench-redeploy").to(compute)
                    t1 = clock()
                    got = new()
                    t2 = clock()
                    old, remote = remote, new
                    self.remotes.append(new)
                    with contextlib.suppress(ValueError):
                        self.remotes.remove(old)
                    old.deployment.close()
                    if got != v:
                        raise RuntimeError(
                            f"after redeploying version {v} the call returned {got!r}"
                        )
                    to_s.append(t1 - t0)
                    first_s.append(t2 - t1)
            pids = [r["pid"] for pod in remote.status() for r in pod["ranks"]]
            if pids != pids_before:
                self.notes.append(
                    f"redeploy replaced the rank processes ({pids_before} -> {pids}); "
                    "expected the code to be reloaded into the running ones"
                )
            self.m["kt_redeploy_to"] = {
                **report.reps_summary(to_s),
                "rank_pids_before": pids_before,
                "rank_pids_after": pids,
            }
            self.m["kt_redeploy_first_call"] = report.reps_summary(first_s)
        finally:
            self.teardown(remote)

    # ---- 100 MB transfers beside loopback TCP, round by round ------------------------------

    def transfers(self) -> None:
        kinds = [k for k, ok in (("numpy", HAVE_NUMPY), ("torch", HAVE_TORCH)) if ok]
        self.notes += [
            f"{k} is not installed: its transfer rows are skipped"
            for k, ok in (("numpy", HAVE_NUMPY), ("torch", HAVE_TORCH))
            if not ok
        ]
        systems: dict[str, Callable[[int], None]] = {}
        remote = None
        try:
            if kinds:
                remote = self.deploy(xfer, one_pod(), "bench-xfer")
                call = remote.options(stream_logs=False)
                values = {kind: array(kind) for kind in kinds}

                def kt_round(r: int) -> None:
                    for kind in kinds:
                        for direction in ("arg", "result"):
                            self.samples[f"kt_{kind}_{direction}_mbps"].append(
                                self._transfer(call, kind, direction, values[kind], warm=r == 0)
                            )

                systems["kt"] = kt_round

            def tcp_round(r: int) -> None:
                if r == 0:
                    loopback_tcp_mbps(XFER_BYTES)  # warm-up
                self.samples["loopback_tcp_mbps"].append(loopback_tcp_mbps(XFER_BYTES))

            systems["loopback_tcp"] = tcp_round
            failed = self.in_rounds("100 MB transfers", systems, self.xfer_reps)
        finally:
            if remote is not None:
                self.teardown(remote)
        keys = (
            [f"kt_{k}_{d}_mbps" for k in kinds for d in ("arg", "result")]
            if "kt" not in failed
            else []
        )
        for key in [*keys, *(["loopback_tcp_mbps"] if "loopback_tcp" not in failed else [])]:
            self.m[key] = report.rate_summary(self.samples[key])

    def _transfer(self, call: Any, kind: str, direction: str, value: Any, warm: bool) -> float:
        def one() -> None:
            if direction == "arg":
                if call(value) is not None:
                    raise RuntimeError("xfer(arg) returned something")
            else:
                got = call(kind=kind)
                if type(got) is not type(value) or tuple(got.shape) != tuple(value.shape):
                    raise RuntimeError(f"xfer(kind={kind}) returned {type(got)}")

        if warm:
            one()  # imports, first allocation of the held result
        gc.collect()
        t = clock()
        one()
        return XFER_BYTES / (clock() - t) / MB

    # ---- the gloo job: ktlite's cold start beside torchrun's launch, round by round -----------

    def gloo(self) -> None:
        if not HAVE_TORCH:
            self.notes.append("torch is not installed: the gloo / torchrun rows are skipped")
            return
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=4",
            "--standalone",
            str(HERE / "_torchrun_job.py"),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}

        def torchrun(r: int) -> None:
            code, text, wall = run_timed(cmd, 300, cwd=str(ROOT), env=env)
            if code != 0:
                raise RuntimeError(f"torchrun exited with code {code}: {text.strip()[-800:]}")
            self.samples["torchrun_launch"].append(wall)

        log(
            "torchrun: a first launch of the gloo job, not counted (it warms the page cache for torch)"
        )
        systems: dict[str, Callable[[int], None]] = {"kt_gloo": self._gloo_round}
        try:
            torchrun(-1)
            self.samples.pop("torchrun_launch")
            systems["torchrun"] = torchrun
        except RuntimeError as e:
            self.notes.append(f"torchrun rows skipped: {e}")
        try:
            failed = self.in_rounds("gloo job, cold", systems, self.reps)
            if "torchrun" in systems and "torchrun" not in failed:
                self.m["torchrun_launch"] = report.reps_summary(self.samples["torchrun_launch"])
            if "kt_gloo" not in failed:
                self.m["kt_gloo_cold_to"] = report.reps_summary(self.samples["kt_gloo_cold_to"])
                self.m["kt_gloo_cold_total"] = report.reps_summary(
                    self.samples["kt_gloo_cold_total"]
                )
                self._gloo_warm(self.remotes[-1])
        finally:
            self.close()

    def _gloo_round(self, r: int) -> None:
        compute = kt.Compute(cpus=1, memory="2Gi", stream_logs=False).distribute(
            "pytorch", workers=2, num_proc=2
        )
        t0 = clock()
        remote = self.deploy(allreduce_job, compute, f"bench-gloo-{os.getpid()}-{r}")
        t1 = clock()
        got = remote()
        t2 = clock()
        if r < self.reps - 1 or got != [6.0] * 4:
            self.teardown(remote)  # the last round's deployment stays for the warm re-runs
        if got != [6.0] * 4:
            raise RuntimeError(f"the gloo job returned {got!r}")
        self.samples["kt_gloo_cold_to"].append(t1 - t0)
        self.samples["kt_gloo_cold_total"].append(t2 - t0)

    def _gloo_warm(self, remote: Any) -> None:
        log(f"ktlite warm re-run of the gloo job: {self.gloo_reruns} time(s)")
        call = remote.options(stream_logs=False)
        call()
        warm = []
        with self.load.step(f"gloo job, warm x{self.gloo_reruns}"):
            for _ in range(self.gloo_reruns):
                t = clock()
                got = call()
                warm.append(clock() - t)
                if got != [6.0] * 4:
                    raise RuntimeError(f"the warm gloo job returned {got!r}")
        self.m["kt_gloo_warm"] = report.reps_summary(warm)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer rounds and iterations (a smoke run, noisier numbers)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every measurement to PATH")
    p.add_argument(
        "--skip-ray", action="store_true", help="leave Ray out even when it is installed"
    )
    args = p.parse_args()

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    bench = Bench(args.quick, ray=HAVE_RAY and not args.skip_ray)
    started = clock()
    try:
        for step in (bench.calls, bench.cold_start, bench.redeploy, bench.transfers, bench.gloo):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - one broken measurement must not hide the others
                bench.notes.append(f"{step.__name__} failed: {type(e).__name__}: {e}")
                log(f"{step.__name__} FAILED: {type(e).__name__}: {e}")
    finally:
        bench.close()
        shutil.rmtree(_HOME, ignore_errors=True)

    cpu = os.cpu_count()
    rows, targets = report.show(
        f"\nktlite {kt.__version__} benchmark{' (--quick)' if args.quick else ''}: Python "
        f"{platform.python_version()}, {cpu} CPU(s), {platform.machine()}, {clock() - started:.0f} s; "
        f"latencies over {bench.per_round() * bench.rounds} calls in {bench.rounds} rounds, each after "
        f"{bench.warmup} ({bench.warm(1)} in later rounds) warm-up calls; others median of {bench.reps} "
        f"(cold/torchrun), {bench.redeploys} (redeploy), {bench.gloo_reruns} (gloo re-run); MB/s best of "
        f"{bench.xfer_reps}, MB = 10^6 bytes; rows with peers interleaved round by round, order rotated",
        bench.m,
        bench.load,
        bench.notes,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "quick": args.quick,
                    "python": platform.python_version(),
                    "cpus": cpu,
                    "ktlite": kt.__version__,
                    "metrics": bench.m,
                    "samples": bench.samples,
                    "load": bench.load.as_json(),
                    "notes": bench.notes,
                    "table": rows,
                    "targets": targets,
                },
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
