"""ktlite benchmark: ktlite's numbers side by side with its peers, as ratios (ktlite / peer).

    python bench/bench.py            # full run (several minutes)
    python bench/bench.py --quick    # fewer iterations, same measurements
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

Everything it starts it stops. It uses a private KTLITE_HOME, so it never touches the
deployments of tests or of the user.
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
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests' deployments
os.environ.pop("KTLITE_BACKEND", None)
sys.path.insert(0, str(HERE))

import httpx  # noqa: E402
from _torchrun_job import allreduce_job  # noqa: E402

import ktlite as kt  # noqa: E402

MB = 1_000_000
XFER_BYTES = 100 * MB
HAVE_NUMPY = importlib.util.find_spec("numpy") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_RAY = importlib.util.find_spec("ray") is not None
clock = time.perf_counter


# ---- the functions that run remotely (defined in __main__: shipped by value) ----------------

def noop() -> None:
    return None


_HELD: dict[str, Any] = {}  # filled on the rank only: each result array is built once, then reused


def xfer(x: Any = None, kind: str | None = None) -> Any:
    """With ``x``: take an argument and return None. With ``kind``: return a held 100 MB array."""
    if kind is None:
        return None
    held = _HELD.get(kind)
    if held is None:
        if kind == "numpy":
            import numpy

            held = numpy.ones(XFER_BYTES // 4, dtype=numpy.float32)
        else:
            import torch

            held = torch.ones(XFER_BYTES // 4, dtype=torch.float32)
        _HELD[kind] = held
    return held


def versioned(version: int) -> Callable[[], int]:
    """A function named ``bench_redeploy`` whose body returns ``version``: an edited function."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(f"def bench_redeploy():\n    return {version}\n", "<bench-edit>", "exec"), namespace)
    fn: Callable[[], int] = namespace["bench_redeploy"]
    return fn


# ---- helpers -----------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(samples)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def latencies(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    gc.collect()
    out = []
    for _ in range(iters):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def lat_summary(samples: list[float]) -> dict[str, Any]:
    return {"p50": percentile(samples, 50), "p99": percentile(samples, 99), "mean": statistics.fmean(samples),
            "min": min(samples), "max": max(samples), "n": len(samples)}


def reps_summary(samples: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "best": min(samples), "samples": samples}


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r:,.0f} MB/s"


class Bench:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.iters = 60 if quick else 300
        self.warmup = 10 if quick else 30
        self.reps = 1 if quick else 3  # cold starts, torchrun launches
        self.xfer_reps = 2 if quick else 3
        self.redeploys = 3 if quick else 6
        self.gloo_reruns = 3 if quick else 10
        self.m: dict[str, Any] = {}  # metric -> summary
        self.notes: list[str] = []
        self.remotes: list[Any] = []
        self.procs: list[subprocess.Popen[Any]] = []
        self.base = kt.Compute(cpus=1, memory="1Gi", stream_logs=False)

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

    def stop_proc(self, proc: subprocess.Popen[Any]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        with contextlib.suppress(ValueError):
            self.procs.remove(proc)

    def close(self) -> None:
        for remote in list(self.remotes):
            self.teardown(remote)
        for proc in list(self.procs):
            with contextlib.suppress(Exception):
                self.stop_proc(proc)

    def run_subprocess(self, cmd: list[str], timeout: float, **kw: Any) -> tuple[int, str, float]:
        """Run ``cmd`` in its own session; returns (code, output, wall seconds)."""
        t = clock()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, **kw)
        self.procs.append(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop_proc(proc)
            return -1, f"timed out after {timeout:g}s", clock() - t
        wall = clock() - t
        with contextlib.suppress(ValueError):
            self.procs.remove(proc)
        return proc.returncode, out, wall

    # ---- references ----------------------------------------------------------------------

    def loopback_tcp(self) -> None:
        log("loopback TCP: 100 MB over a 127.0.0.1 socket pair")
        payload = memoryview(bytearray(XFER_BYTES))
        sink = memoryview(bytearray(1 << 20))
        rates = []
        for _ in range(self.xfer_reps + 1):
            with socket.create_server(("127.0.0.1", 0)) as server:
                a = socket.create_connection(server.getsockname())
                b, _ = server.accept()

                def drain(conn: socket.socket = b) -> None:
                    got = 0
                    while got < XFER_BYTES:
                        n = conn.recv_into(sink)
                        if n == 0:
                            break
                        got += n

                reader = threading.Thread(target=drain)
                reader.start()
                t = clock()
                a.sendall(payload)
                reader.join()
                rates.append(XFER_BYTES / (clock() - t) / MB)
                a.close()
                b.close()
        rates = rates[1:]  # the first is a warm-up
        self.m["loopback_tcp_mbps"] = {"best": max(rates), "median": statistics.median(rates), "samples": rates}

    def raw_fastapi(self) -> None:
        log(f"raw FastAPI + httpx + cloudpickle: {self.iters} calls")
        import cloudpickle

        proc = subprocess.Popen([sys.executable, str(HERE / "_raw_server.py"), "--parent-pid", str(os.getpid())],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + 60
            line = ""
            while time.monotonic() < deadline and proc.poll() is None:
                ready, _, _ = select.select([proc.stdout], [], [], 0.2)
                if ready:
                    line = proc.stdout.readline()
                    break
            if not line.startswith("PORT "):
                err = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
                self.notes.append(f"raw FastAPI server did not start: {line!r} {err[-500:]}")
                return
            _, port, loop, http = line.split()
            url = f"http://127.0.0.1:{port}/call"
            with httpx.Client(timeout=30.0) as client:
                def one() -> None:
                    body = cloudpickle.dumps(((), {}))
                    resp = client.post(url, content=body, headers={"content-type": "application/octet-stream"})
                    resp.raise_for_status()
                    cloudpickle.loads(resp.content)

                samples = latencies(one, self.iters, self.warmup)
            self.m["raw_fastapi"] = {**lat_summary(samples), "server": f"uvicorn loop={loop} http={http}"}
        finally:
            self.stop_proc(proc)

    def ray(self) -> None:
        if not HAVE_RAY:
            self.notes.append("Ray is not installed: its rows are skipped (pip install ray to compare)")
            return
        log(f"Ray (separate process): actor call and fan-out to 2 and 4 actors, {self.iters} calls each")
        tmp = tempfile.mkdtemp(prefix="kb-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
        out = os.path.join(tmp, "result.json")
        try:
            code, text, wall = self.run_subprocess(
                [sys.executable, str(HERE / "_ray_peer.py"), "--iters", str(self.iters), "--warmup",
                 str(self.warmup), "--fanout", "2", "4", "--out", out, "--temp-dir", os.path.join(tmp, "r")],
                timeout=600)
            if code != 0:
                self.notes.append(f"Ray peer failed (exit {code}); its rows are skipped: {text.strip()[-800:]}")
                return
            with open(out) as f:
                data = json.load(f)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.m["ray_version"] = data["ray_version"]
        self.m["ray_init_s"] = data["init_s"]
        self.m["ray_actor_call"] = lat_summary(data["actor_call"])
        for n in (2, 4):
            self.m[f"ray_fanout_{n}"] = lat_summary(data[f"fanout_{n}"])

    # ---- ktlite --------------------------------------------------------------------------

    def warm_call(self) -> None:
        log(f"ktlite warm call, 1 worker: {self.iters} calls")
        remote = self.deploy(noop, self.base, "bench-noop")
        try:
            call = remote.options(stream_logs=False)
            self.m["kt_warm_call"] = lat_summary(latencies(call, self.iters, self.warmup))
        finally:
            self.teardown(remote)

    def distributed_calls(self) -> None:
        for workers, procs in ((2, 1), (4, 1), (2, 2)):
            n = workers * procs
            log(f"ktlite warm distributed call, {workers} pods x {procs} ranks: {self.iters} calls")
            compute = self.base.distribute("spmd", workers=workers, num_proc=procs)
            remote = self.deploy(noop, compute, f"bench-spmd-{workers}x{procs}")
            try:
                call = remote.options(stream_logs=False)
                got = call()
                if got != [None] * n:
                    raise RuntimeError(f"{workers}x{procs} call returned {got!r}")
                self.m[f"kt_dist_{workers}x{procs}"] = lat_summary(latencies(call, self.iters, self.warmup))
            finally:
                self.teardown(remote)

    def cold_start(self) -> None:
        log(f"ktlite cold .to() + first call, fresh name, 1 worker: {self.reps} time(s)")
        to_s, first_s, total = [], [], []
        for i in range(self.reps):
            t0 = clock()
            remote = self.deploy(noop, self.base, f"bench-cold-{os.getpid()}-{i}")
            t1 = clock()
            remote()
            t2 = clock()
            self.teardown(remote)
            to_s.append(t1 - t0)
            first_s.append(t2 - t1)
            total.append(t2 - t0)
        self.m["kt_cold_to"] = reps_summary(to_s)
        self.m["kt_cold_first_call"] = reps_summary(first_s)
        self.m["kt_cold_total"] = reps_summary(total)

    def redeploy(self) -> None:
        log(f"ktlite redeploy after a code change: {self.redeploys} time(s)")
        remote = self.deploy(versioned(0), self.base, "bench-redeploy")
        try:
            if remote() != 0:
                raise RuntimeError("the first version did not run")
            pids_before = [r["pid"] for pod in remote.status() for r in pod["ranks"]]
            to_s, first_s = [], []
            for v in range(1, self.redeploys + 1):
                fn = versioned(v)
                t0 = clock()
                new = kt.fn(fn, name="bench-redeploy").to(self.base)
                t1 = clock()
                got = new()
                t2 = clock()
                old, remote = remote, new
                self.remotes.append(new)
                with contextlib.suppress(ValueError):
                    self.remotes.remove(old)
                old.deployment.close()
                if got != v:
                    raise RuntimeError(f"after redeploying version {v} the call returned {got!r}")
                to_s.append(t1 - t0)
                first_s.append(t2 - t1)
            pids = [r["pid"] for pod in remote.status() for r in pod["ranks"]]
            if pids != pids_before:
                self.notes.append(f"redeploy replaced the rank processes ({pids_before} -> {pids}); "
                                  "expected the code to be reloaded into the running ones")
            self.m["kt_redeploy_to"] = {**reps_summary(to_s), "rank_pids_before": pids_before,
                                        "rank_pids_after": pids}
            self.m["kt_redeploy_first_call"] = reps_summary(first_s)
        finally:
            self.teardown(remote)

    def transfers(self) -> None:
        kinds = [k for k, ok in (("numpy", HAVE_NUMPY), ("torch", HAVE_TORCH)) if ok]
        for k, ok in (("numpy", HAVE_NUMPY), ("torch", HAVE_TORCH)):
            if not ok:
                self.notes.append(f"{k} is not installed: its transfer rows are skipped")
        if not kinds:
            return
        log(f"ktlite 100 MB transfers ({', '.join(kinds)}): best of {self.xfer_reps}")
        remote = self.deploy(xfer, self.base, "bench-xfer")
        try:
            call = remote.options(stream_logs=False)
            for kind in kinds:
                if kind == "numpy":
                    import numpy

                    value: Any = numpy.ones(XFER_BYTES // 4, dtype=numpy.float32)
                else:
                    import torch

                    value = torch.ones(XFER_BYTES // 4, dtype=torch.float32)
                for direction in ("arg", "result"):
                    rates = self._transfer(call, kind, direction, value)
                    self.m[f"kt_{kind}_{direction}_mbps"] = {"best": max(rates), "median": statistics.median(rates),
                                                             "samples": rates}
                value = None  # free the 100 MB before the next kind
        finally:
            self.teardown(remote)

    def _transfer(self, call: Any, kind: str, direction: str, value: Any) -> list[float]:
        def one() -> None:
            if direction == "arg":
                if call(value) is not None:
                    raise RuntimeError("xfer(arg) returned something")
            else:
                got = call(kind=kind)
                if type(got) is not type(value) or tuple(got.shape) != tuple(value.shape):
                    raise RuntimeError(f"xfer(kind={kind}) returned {type(got)}")

        one()  # warm-up: imports, first allocation of the held result
        times = []
        for _ in range(self.xfer_reps):
            gc.collect()
            t = clock()
            one()
            times.append(clock() - t)
        return [XFER_BYTES / s / MB for s in times]

    def gloo(self) -> None:
        if not HAVE_TORCH:
            self.notes.append("torch is not installed: the gloo / torchrun rows are skipped")
            return
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--standalone",
               str(HERE / "_torchrun_job.py")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
        log(f"torchrun launching the 4-rank gloo all_reduce job: {self.reps + 1} time(s)")
        walls = []
        for i in range(self.reps + 1):
            code, text, wall = self.run_subprocess(cmd, timeout=300, cwd=str(ROOT), env=env)
            if code != 0:
                self.notes.append(f"torchrun failed (exit {code}); its rows are skipped: {text.strip()[-800:]}")
                return
            if i > 0 or self.reps == 0:
                walls.append(wall)  # the first launch warms the page cache for torch's files
        self.m["torchrun_launch"] = reps_summary(walls)

        compute = kt.Compute(cpus=1, memory="2Gi", stream_logs=False).distribute("pytorch", workers=2, num_proc=2)
        log(f"ktlite cold .to() + first call of the same job (pytorch 2x2): {self.reps} time(s)")
        cold, to_s = [], []
        remote = None
        for i in range(self.reps):
            if remote is not None:
                self.teardown(remote)
            t0 = clock()
            remote = self.deploy(allreduce_job, compute, f"bench-gloo-{os.getpid()}-{i}")
            t1 = clock()
            got = remote()
            t2 = clock()
            if got != [6.0] * 4:
                raise RuntimeError(f"the gloo job returned {got!r}")
            to_s.append(t1 - t0)
            cold.append(t2 - t0)
        self.m["kt_gloo_cold_to"] = reps_summary(to_s)
        self.m["kt_gloo_cold_total"] = reps_summary(cold)
        assert remote is not None
        try:
            log(f"ktlite warm re-run of the gloo job: {self.gloo_reruns} time(s)")
            call = remote.options(stream_logs=False)
            call()
            warm = []
            for _ in range(self.gloo_reruns):
                t = clock()
                got = call()
                warm.append(clock() - t)
                if got != [6.0] * 4:
                    raise RuntimeError(f"the warm gloo job returned {got!r}")
            self.m["kt_gloo_warm"] = reps_summary(warm)
        finally:
            self.teardown(remote)

    # ---- report --------------------------------------------------------------------------

    def table(self) -> tuple[list[list[str]], list[list[str]]]:
        m = self.m
        rows: list[list[str]] = []

        def get(key: str, stat: str) -> float | None:
            v = m.get(key)
            return None if v is None else v.get(stat)

        def add(what: str, kv: float | None, peer: str, pv: float | None, fmt: Callable[[float | None], str],
                extra: str = "") -> None:
            ratio = "-" if kv is None or pv is None or not pv else f"{kv / pv:.2f}"
            rows.append([what, fmt(kv), peer, fmt(pv), ratio + extra])

        for stat in ("p50", "p99"):
            kv = get("kt_warm_call", stat)
            add(f"warm call {stat} (1 worker, no-op)", kv, "raw FastAPI+httpx+cloudpickle",
                get("raw_fastapi", stat), fmt_time)
            add(f"warm call {stat} (1 worker, no-op)", kv, "Ray actor call", get("ray_actor_call", stat), fmt_time)
        for shape, n in (("2x1", 2), ("4x1", 4), ("2x2", 4)):
            for stat in ("p50", "p99"):
                add(f"{n}-rank call {stat} ({shape}, spmd no-op)", get(f"kt_dist_{shape}", stat),
                    f"Ray fan-out to {n} actors", get(f"ray_fanout_{n}", stat), fmt_time)
        rows.append(["cold .to() -> first result (1 worker)", fmt_time(get("kt_cold_total", "median")),
                     "ray.init + 4 actors + first call (ref)", fmt_time(m.get("ray_init_s")),
                     "-" if m.get("ray_init_s") is None or get("kt_cold_total", "median") is None else
                     f"{get('kt_cold_total', 'median') / m['ray_init_s']:.2f}"])
        tr = get("torchrun_launch", "median")
        add("cold .to() + first 4-rank gloo call (2x2)", get("kt_gloo_cold_total", "median"),
            "torchrun launch, 4 ranks", tr, fmt_time)
        warm = get("kt_gloo_warm", "median")
        add("warm re-run, 4-rank gloo job (2x2)", warm, "torchrun launch, 4 ranks", tr, fmt_time,
            f" ({tr / warm:.0f}x faster)" if warm and tr else "")
        rows.append(["redeploy after a code change: .to()", fmt_time(get("kt_redeploy_to", "median")),
                     "-", "-", "-"])
        rows.append(["redeploy: first call after it (no-op)", fmt_time(get("kt_redeploy_first_call", "median")),
                     "-", "-", "-"])
        tcp = get("loopback_tcp_mbps", "best")
        for kind in ("numpy", "torch"):
            for direction, label in (("arg", "argument"), ("result", "result")):
                add(f"100 MB {kind} as {label}", get(f"kt_{kind}_{direction}_mbps", "best"),
                    "loopback TCP (100 MB)", tcp, fmt_rate)

        targets: list[list[str]] = []

        def target(what: str, ok: bool | None, measured: str) -> None:
            targets.append([what, measured, "n/a" if ok is None else ("yes" if ok else "NO")])

        p50 = get("kt_warm_call", "p50")
        target("warm call p50 <= 1.5 ms", None if p50 is None else p50 <= 1.5e-3, fmt_time(p50))
        ray1 = get("ray_actor_call", "p50")
        target("warm call p50 <= Ray actor call p50", None if p50 is None or ray1 is None else p50 <= ray1,
               f"{fmt_time(p50)} vs {fmt_time(ray1)}")
        ray4 = get("ray_fanout_4", "p50")
        for shape in ("4x1", "2x2"):
            k4 = get(f"kt_dist_{shape}", "p50")
            target(f"4-rank call ({shape}) p50 <= Ray 4-actor fan-out p50",
                   None if k4 is None or ray4 is None else k4 <= ray4, f"{fmt_time(k4)} vs {fmt_time(ray4)}")
        for direction in ("arg", "result"):
            r = get(f"kt_torch_{direction}_mbps", "best")
            target(f"100 MB tensor as {direction} >= 1 GB/s", None if r is None else r >= 1000, fmt_rate(r))
        rd = get("kt_redeploy_to", "median")
        target("redeploy < 1 s", None if rd is None else rd < 1.0, fmt_time(rd))
        target("warm gloo re-run >= 20x faster than torchrun launch",
               None if warm is None or tr is None else tr / warm >= 20,
               "-" if warm is None or tr is None else f"{tr / warm:.0f}x")
        cold = get("kt_gloo_cold_total", "median")
        target("cold .to() + first 4-rank call <= torchrun launch",
               None if cold is None or tr is None else cold <= tr, f"{fmt_time(cold)} vs {fmt_time(tr)}")
        return rows, targets


def render(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), line]
    out += ["  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run, noisier numbers)")
    p.add_argument("--json", metavar="PATH", help="also write every measurement to PATH")
    p.add_argument("--skip-ray", action="store_true", help="leave Ray out even when it is installed")
    args = p.parse_args()

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    global HAVE_RAY
    if args.skip_ray:
        HAVE_RAY = False

    bench = Bench(args.quick)
    started = clock()
    steps = [bench.loopback_tcp, bench.raw_fastapi, bench.warm_call, bench.distributed_calls,
             bench.cold_start, bench.redeploy, bench.transfers, bench.gloo, bench.ray]
    try:
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - one broken measurement must not hide the others
                bench.notes.append(f"{step.__name__} failed: {type(e).__name__}: {e}")
                log(f"{step.__name__} FAILED: {type(e).__name__}: {e}")
    finally:
        bench.close()
        shutil.rmtree(_HOME, ignore_errors=True)

    rows, targets = bench.table()
    cpu = os.cpu_count()
    print(f"\nktlite {kt.__version__} benchmark{' (--quick)' if args.quick else ''}: Python "
          f"{platform.python_version()}, {cpu} CPU(s), {platform.machine()}, {clock() - started:.0f} s; "
          f"latencies over {bench.iters} calls after {bench.warmup} warm-up; others median of "
          f"{bench.reps} (cold/torchrun), {bench.redeploys} (redeploy), {bench.gloo_reruns} (gloo re-run); "
          f"MB/s best of {bench.xfer_reps}, MB = 10^6 bytes")
    print("ratio = ktlite / peer: below 1 is faster for times, above 1 is faster for MB/s\n")
    print(render(rows, ["measurement", "ktlite", "peer", "peer value", "ratio"]))
    print()
    print(render(targets, ["target", "measured", "met"]))
    if bench.notes:
        print("\nnotes:")
        for n in bench.notes:
            print(f"- {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"quick": args.quick, "python": platform.python_version(), "cpus": cpu,
                       "ktlite": kt.__version__, "metrics": bench.m, "notes": bench.notes,
                       "table": rows, "targets": targets}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
