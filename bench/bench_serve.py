"""Serving benchmark (issue 14): an autoscaled ktlite class beside a plain server and Ray Serve.

    python bench/bench_serve.py                        # every row, about 4 minutes on 2 cores
    python bench/bench_serve.py --quick                # 1 round of 2 s windows (about 3 minutes)
    python bench/bench_serve.py --only ktlite,floor    # leave Ray Serve out
    python bench/bench_serve.py --json out.json        # also write every number to out.json

One small torch model (``bench/_serve_peers.py``: ``Model.predict``, a 32 x 256 float32 batch
in, 32 class ids out, one torch thread, a few ms a call) served three ways, each with 1 and 4
replicas, each driven by the same load generator (N threads, each keeping one blocking call
in flight, at N = 1, 8 and 32) for a fixed window after a warm-up. ktlite and the floor are up
together and take turns on each cell (best of 2 rounds, the order rotated between rounds:
``_rounds.py``), so both see the same background load; the load average is recorded around
each round and printed with the table:

- ktlite: ``kt.cls(Model).to(Compute(cpus=1).autoscale(min_scale=R, max_scale=R,
  concurrency=8))`` on the local backend, called with ``remote.predict(x)``;
- the floor: ``bench/_raw_server.py`` (uvicorn + FastAPI, uvloop + httptools) serving the
  same model in R processes, called over HTTP with cloudpickled bodies, each call to the
  least-loaded of the R ports;
- the peer: Ray Serve, a deployment with ``num_replicas=R`` and ``max_ongoing_requests=8``,
  called through its ``DeploymentHandle`` (in its own process, after ktlite is torn down).

Then the scale-to-zero cold start: a ``min_scale=0`` deployment is left idle until it has no
replica, and the first call (which starts one) is timed against the next.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-serve-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests' deployments
os.environ.pop("KTLITE_BACKEND", None)
sys.path.insert(0, str(HERE))

import _serve_peers as peers  # noqa: E402
from _rounds import LoadLog, run_rounds  # noqa: E402
from _serve_report import INFLIGHT, LABEL, REPLICAS, fairness, ms, table, verdict  # noqa: E402

import ktlite as kt  # noqa: E402

clock = time.perf_counter
CONCURRENCY = 8  # calls one replica runs at once: ktlite's concurrency, Ray's max_ongoing_requests
SYSTEMS = ("ktlite", "floor", "ray")


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def wait_replicas(remote: Any, want: int, timeout: float) -> float:
    """Poll ``remote.status()`` until it shows ``want`` replicas; returns the seconds waited."""
    t0 = clock()
    while (n := len(remote.status()["replicas"])) != want:
        if clock() - t0 > timeout:
            raise RuntimeError(
                f"{remote.name}: {n} replica(s) after {timeout:.0f} s, waiting for {want}"
            )
        time.sleep(0.1)
    return clock() - t0


class FloorServers:
    """The floor's server processes (``bench/_serve_peers.py floor``), grown one at a time."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.ports: list[int] = []
        self.how = ""

    def grow(self, count: int) -> list[int]:
        while len(self.ports) < count:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "_serve_peers.py"),
                    "floor",
                    "--width",
                    str(peers.WIDTH),
                    "--parent-pid",
                    str(os.getpid()),
                ],
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self.procs.append(proc)
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.startswith("PORT "):
                raise RuntimeError(f"the floor server did not start: {line!r}")
            self.ports.append(int(line.split()[1]))
            self.how = " + ".join(line.split()[2:4])
        return self.ports[:count]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Bench:
    def __init__(self, seconds: float, warmup: float, rounds: int) -> None:
        self.seconds, self.warmup, self.rounds = seconds, warmup, rounds
        self.rows: dict[str, dict[str, float]] = {}  # "system/replicas/inflight" -> rps, p50, p99
        self.cold: dict[str, dict[str, float]] = {}  # system -> cold, warm (seconds)
        self.notes: list[str] = []
        self.meta: dict[str, Any] = {}
        self.load = LoadLog()
        self.x = peers.example_input()
        self.expected = peers.Model().predict(self.x)  # every row must answer this

    # ---- ktlite and the floor, side by side ---------------------------------------------------

    def served(self, systems: list[str]) -> None:
        """For each replica count: ktlite's deployment and the floor's servers both up, each
        cell driven on one, then the other, ``rounds`` times (the best round is kept), so that
        both see the same background load of this machine."""
        floor = FloorServers() if "floor" in systems else None
        try:
            for r in REPLICAS:
                calls: dict[str, Any] = {}
                remote, client = None, None
                try:
                    if "ktlite" in systems:
                        try:
                            remote = self.deploy(r)
                            calls["ktlite"] = lambda m=remote.predict: m(self.x)
                        except Exception as e:  # noqa: BLE001 - the floor's rows still run
                            self.notes.append(
                                f"ktlite with {r} replica(s) failed: {type(e).__name__}: {e}"
                            )
                            log(f"ktlite FAILED: {type(e).__name__}: {e}")
                    if floor is not None:
                        client = peers.FloorClient(floor.grow(r))
                        self.meta["floor_server"] = floor.how
                        if client(self.x) != self.expected:
                            raise RuntimeError(
                                "the floor answered something else than the local model"
                            )
                        calls["floor"] = lambda c=client: c(self.x)
                    for n in INFLIGHT:  # each round drives each system once, the order rotated
                        run_rounds(
                            f"{r} replica(s), {n} in flight",
                            {s: self.cell(s, call, r, n) for s, call in calls.items()},
                            self.rounds,
                            self.load,
                            lambda s, e, r=r, n=n: self.failed(
                                f"{s}, {r} replica(s), {n} in flight", e
                            ),
                        )
                finally:
                    if client is not None:
                        client.close()
                    if remote is not None:
                        remote.teardown()
        finally:
            if floor is not None:
                floor.stop()

    def cell(self, system: str, call: Any, replicas: int, inflight: int) -> Any:
        """One round of a cell: ``call`` driven with ``inflight`` calls in flight; the best round is kept."""

        def one(i: int) -> None:
            log(
                f"{system}: {replicas} replica(s), {inflight} in flight, round {i + 1}/{self.rounds}: "
                f"{self.warmup:g} s + {self.seconds:g} s"
            )
            row = peers.drive(call, inflight, self.seconds, self.warmup)
            key = f"{system}/{replicas}/{inflight}"
            if key not in self.rows or row["rps"] > self.rows[key]["rps"]:
                self.rows[key] = row

        return one

    def failed(self, system: str, e: BaseException) -> None:
        self.notes.append(f"{system} failed: {type(e).__name__}: {e}")
        log(f"{system} FAILED: {type(e).__name__}: {e}")

    def deploy(self, replicas: int) -> Any:
        """``kt.cls(Model)`` on exactly ``replicas`` replicas, each taking calls."""
        compute = kt.Compute(cpus=1, stream_logs=False).autoscale(
            min_scale=replicas, max_scale=replicas, concurrency=CONCURRENCY
        )
        t = clock()
        remote = kt.cls(peers.Model, name=f"serve-bench-{replicas}").to(
            compute, init_args={"width": peers.WIDTH}
        )
        try:
            wait_replicas(remote, replicas, 120)
            if remote.predict(self.x) != self.expected:
                raise RuntimeError("ktlite's replica answered something else than the local model")
        except BaseException:
            remote.teardown()
            raise
        self.meta[f"ktlite_deploy_{replicas}"] = clock() - t
        return remote

    def ktlite_cold(self) -> None:
        x = self.x
        compute = kt.Compute(cpus=1, stream_logs=False).autoscale(
            min_scale=0,
            max_scale=1,
            concurrency=CONCURRENCY,
            window="2s",
            scale_down_delay="1s",
            scale_to_zero_pod_retention_period="2s",
        )
        remote = kt.cls(peers.Model, name="serve-bench-cold").to(
            compute, init_args={"width": peers.WIDTH}
        )
        try:
            remote.predict(x)
            log("ktlite: waiting for 0 replicas (retention 2 s)")
            idle = wait_replicas(remote, 0, 90)
            t = clock()
            remote.predict(x)
            cold = clock() - t
            t = clock()
            remote.predict(x)
            self.cold["ktlite"] = {"cold": cold, "warm": clock() - t, "to_zero": idle}
        finally:
            remote.teardown()

    # ---- Ray Serve -------------------------------------------------------------------------

    def ray(self, python: str, cold: bool) -> None:
        out = Path(_HOME) / "ray.json"
        cmd = [
            python,
            str(HERE / "_serve_peers.py"),
            "ray",
            "--out",
            str(out),
            "--width",
            str(peers.WIDTH),
            "--seconds",
            str(self.seconds),
            "--warmup",
            str(self.warmup),
            "--concurrency",
            str(CONCURRENCY),
            "--inflight",
            *map(str, INFLIGHT),
            "--replicas",
            *map(str, REPLICAS),
            *(["--cold"] if cold else []),
        ]
        log(f"ray serve: {' '.join(cmd[1:3])} (with {python})")
        env = {
            **os.environ,
            "TMPDIR": _HOME,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p
            ),
        }
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        try:
            text, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            raise RuntimeError("the Ray Serve peer ran past 600 s") from None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever Ray's runtime left behind
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join(line for line in text.strip().splitlines() if "[bench]" not in line)[
                -600:
            ]
            raise RuntimeError(f"the Ray Serve peer exited with code {proc.returncode}: {tail}")
        data = json.loads(out.read_text())
        probes = text.count("Failed to get queue length")
        if probes:
            self.notes.append(
                f"Ray Serve's router logged {probes} queue-length probes to its replicas that missed "
                "their deadline (RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S, 0.1 s): calls wait for "
                "them, which is most of its latency at 32 in flight on a busy machine"
            )
        if "skipped" in data:
            self.notes.append(f"Ray Serve skipped: {data['skipped']}")
            return
        self.meta["ray_version"] = data["version"]
        for key, row in data["rows"].items():
            r, n = key.split("x")
            self.rows[f"ray/{r}/{n}"] = row
        if "cold" in data:
            self.cold["ray"] = data["cold"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="1 round of 2 s windows (noisier; about 3 minutes)"
    )
    p.add_argument("--seconds", type=float, help="measured window per cell (default 3, --quick 2)")
    p.add_argument("--warmup", type=float, help="warm-up before each window (default 0.5)")
    p.add_argument(
        "--rounds",
        type=int,
        help="ktlite and the floor alternate this many times per cell, "
        "the best kept (default 2, --quick 1)",
    )
    p.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated: ktlite,floor,ray")
    p.add_argument("--no-cold", action="store_true", help="leave the scale-to-zero cold start out")
    p.add_argument(
        "--peer-python",
        default=sys.executable,
        metavar="PATH",
        help="the Python that runs Ray Serve (default: this one)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every measurement to PATH")
    args = p.parse_args()
    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        p.error(f"--only {args.only!r}: choose from {','.join(SYSTEMS)}")
    systems = [s for s in SYSTEMS if s in systems]

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # runs the cleanup below

    signal.signal(signal.SIGTERM, on_term)

    bench = Bench(
        args.seconds or (2.0 if args.quick else 3.0),
        args.warmup or 0.5,
        args.rounds or (1 if args.quick else 2),
    )
    started = clock()
    steps: list[tuple[str, Any]] = []
    if "ktlite" in systems or "floor" in systems:
        steps.append(("ktlite and the floor", lambda: bench.served(systems)))
    if "ktlite" in systems and not args.no_cold:
        steps.append(("ktlite cold start", bench.ktlite_cold))
    if (
        "ray" in systems
    ):  # last and alone: Ray's runtime never shares the machine with ktlite's pods
        steps.append(("ray", lambda: bench.ray(args.peer_python, not args.no_cold)))
    try:
        for name, step in steps:
            try:
                if name == "ktlite and the floor":  # records each round's load itself
                    step()
                else:
                    with bench.load.step(name):
                        step()
            except Exception as e:  # noqa: BLE001 - one broken row must not hide the others
                bench.notes.append(f"{name} failed: {type(e).__name__}: {e}")
                log(f"{name} FAILED: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(_HOME, ignore_errors=True)

    cores = os.cpu_count() or 1
    ray = f"; Ray {bench.meta['ray_version']}" if "ray_version" in bench.meta else ""
    print(
        f"\nktlite {kt.__version__} ({Path(kt.__file__).parent}) serving benchmark"
        f"{' (--quick)' if args.quick else ''}: Python "
        f"{platform.python_version()}, {cores} CPU(s), {clock() - started:.0f} s{ray}"
    )
    print(bench.load.summary())
    print(
        f"each row: N threads each keeping one call of Model.predict in flight, {bench.warmup:g} s warm-up "
        f"then {bench.seconds:g} s measured; ktlite and the floor alternate (order rotated), best of "
        f"{bench.rounds} round(s); "
        f"Ray once, alone; concurrency {CONCURRENCY} per replica; p50/p99 nearest rank"
    )
    print(
        "kt/X rps = ktlite's req/s / X's (above 1: ktlite serves more); kt/X p50 = ktlite's p50 / X's "
        "(below 1: ktlite answers faster)\n"
    )
    print(table(bench.rows, systems))
    met = verdict(bench.rows)
    if met:
        print(f"\n{met}")
    if cores < max(REPLICAS) + 1:
        print(
            f"\nthis machine has {cores} core(s): {max(REPLICAS)} replicas, the load threads and the servers' "
            "own work share them, so 4 replicas cannot scale linearly over 1 (the 4-replica rows show "
            "the cost of spreading calls, not 4 cores' throughput)"
        )
    if bench.cold:
        print(
            "\nscale-to-zero cold start (min_scale=0, idle until no replica is left; first call vs the next):"
        )
        for s, c in bench.cold.items():
            extra = (
                f", scaled to zero {c['to_zero']:.1f} s after the wait began"
                if "to_zero" in c
                else ""
            )
            print(f"  {LABEL[s]:<7} first call {c['cold']:.2f} s, next call {ms(c['warm'])}{extra}")
    if "floor_server" in bench.meta:
        print(
            f"\nthe floor ran on uvicorn with {bench.meta['floor_server']}; its servers and ktlite's replicas "
            "were up together, each idle while the other was driven"
        )
    if "ray_version" in bench.meta:
        print(
            "Ray Serve was called through its DeploymentHandle (its Python API, as remote.predict is "
            "ktlite's; its HTTP proxy would add a hop and a process on these cores), proxy disabled"
        )
    unfair = fairness(bench.rows)
    if unfair:
        print("\nunfair queueing (calls waiting for a replica not served in arrival order):")
        for line in unfair:
            print(f"  {line}")
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
                    "ktlite": kt.__version__,
                    "cores": cores,
                    "rows": bench.rows,
                    "cold": bench.cold,
                    "meta": bench.meta,
                    "notes": bench.notes,
                    "load": bench.load.as_json(),
                },
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
