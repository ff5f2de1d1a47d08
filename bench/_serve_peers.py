"""Shared parts of ``bench/bench_serve.py``: the model every row serves, the load generator
every row is driven by, the floor (a bare uvicorn + FastAPI server with the model) and the
Ray Serve peer, which runs in a process of its own so Ray's runtime never shares the bench's.

    python bench/_serve_peers.py floor [--width 256]           # prints "PORT <n> <loop> <http>"
    python bench/_serve_peers.py ray --out /tmp/ray.json [--seconds 5 --warmup 1 --inflight 1 8 32]

Nothing heavy is imported at module level: ktlite ships this module by value with ``Model``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WIDTH = 256
BATCH = 32
clock = time.perf_counter


# ---- the model (the same in every row) -------------------------------------------------------


class Model:
    """A small MLP on CPU: a batch of 32 x 256 floats in, 32 class ids out (~2.3 ms here)."""

    def __init__(self, width: int = WIDTH) -> None:
        import torch

        torch.set_num_threads(1)  # one replica = one core, in every row (ktlite, floor, Ray)
        torch.manual_seed(0)
        hidden = 4 * width
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        ).eval()

    def predict(self, x: Any) -> list[int]:
        import torch

        with torch.inference_mode():
            return self.net(torch.from_numpy(x)).argmax(1).tolist()


def example_input(width: int = WIDTH, batch: int = BATCH) -> Any:
    """A numpy array (32 KB): it pickles as one buffer, where a torch tensor's pickle goes
    through ``torch.save``/``torch.load`` (~0.5 ms a call here, in every row alike)."""
    import numpy as np

    return np.random.default_rng(1).standard_normal((batch, width), dtype=np.float32)


# ---- the load generator (the same harness for every row) ------------------------------------


def nearest_rank(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)] if s else float("nan")


def drive(
    call: Callable[[], Any], inflight: int, seconds: float, warmup: float
) -> dict[str, float]:
    """``inflight`` threads, each keeping one blocking ``call()`` in flight, for ``warmup`` s
    and then ``seconds`` s. Throughput counts calls finished inside the measured window;
    latencies are those of every call in flight at some point of it (a call kept waiting
    through the whole window counts too: unfair queueing shows in p99)."""
    window = {"start": 0.0, "end": 0.0}
    records: list[list[tuple[float, float]]] = [[] for _ in range(inflight)]
    errors: list[BaseException] = []
    go = threading.Barrier(inflight + 1)

    def worker(out: list[tuple[float, float]]) -> None:
        go.wait()
        end = window["end"]
        try:
            while (t := clock()) < end:
                call()
                out.append((t, clock()))
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in records]
    for t in threads:
        t.start()
    window["start"] = clock() + warmup
    window["end"] = window["start"] + seconds
    go.wait()
    for t in threads:
        t.join(seconds + warmup + 120)
    if errors:
        raise RuntimeError(
            f"{len(errors)} of {inflight} load threads failed: {errors[0]!r}"
        ) from errors[0]
    start, end = window["start"], window["end"]
    flat = [r for rs in records for r in rs]
    done = sum(1 for _, e in flat if start <= e <= end)
    latencies = [e - b for b, e in flat if b < end and e > start]
    per_thread = [sum(1 for _, e in rs if start <= e <= end) for rs in records]
    return {
        "rps": done / seconds,
        "p50": nearest_rank(latencies, 0.50),
        "p99": nearest_rank(latencies, 0.99),
        "calls": float(len(latencies)),
        "fewest_per_thread": float(min(per_thread)),
        "most_per_thread": float(max(per_thread)),
    }


# ---- the floor: bench/_raw_server.py serving the model --------------------------------------


def serve_floor(width: int, parent_pid: int) -> None:
    """Runs ``bench/_raw_server.py``'s server (uvloop + httptools where installed, one POST
    endpoint, cloudpickled ``(args, kwargs)`` in and the result out) with the model's
    ``predict`` as the function it calls. The endpoint is ``async``: the model runs on the
    event loop, one call at a time per process, as a plain single-worker server does."""
    sys.path.insert(0, str(HERE))
    import _raw_server

    _raw_server.noop = Model(width).predict  # type: ignore[assignment]
    sys.argv = [sys.argv[0], "--parent-pid", str(parent_pid)]
    _raw_server.main()


class FloorClient:
    """Calls N floor servers over HTTP with pickled bodies, each call to the least-loaded port
    (ties rotate), through one shared ``httpx.Client`` (as ktlite's client shares one)."""

    def __init__(self, ports: list[int]) -> None:
        import httpx

        self.urls = [f"http://127.0.0.1:{p}/call" for p in ports]
        self.load = [0] * len(ports)
        self.lock = threading.Lock()
        self.turn = itertools.count()
        self.http = httpx.Client(
            timeout=120, limits=httpx.Limits(max_connections=128, max_keepalive_connections=128)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import cloudpickle

        n = len(self.urls)
        with self.lock:
            first = next(self.turn) % n
            i = min(((first + k) % n for k in range(n)), key=self.load.__getitem__)
            self.load[i] += 1
        try:
            r = self.http.post(self.urls[i], content=cloudpickle.dumps((args, kwargs)))
            r.raise_for_status()
            return cloudpickle.loads(r.content)
        finally:
            with self.lock:
                self.load[i] -= 1

    def close(self) -> None:
        self.http.close()


# ---- the peer: Ray Serve, through its DeploymentHandle --------------------------------------


def run_ray(args: argparse.Namespace) -> dict[str, Any]:
    """Ray Serve rows: a deployment of ``Model`` with ``num_replicas`` 1 and 4 and
    ``max_ongoing_requests`` = ktlite's concurrency, called with
    ``handle.predict.remote(x).result()`` from the same harness; then scale-to-zero."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
        from ray import serve
    except ImportError as e:
        return {"skipped": f"ray.serve does not import here ({e}); pip install 'ray[serve]'"}

    ray.init(
        address="local",
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    out: dict[str, Any] = {"version": ray.__version__, "rows": {}}
    try:
        serve.start(proxy_location="Disabled")  # handle calls only: no HTTP proxy eating a core
        x = example_input(args.width)
        expected = Model(args.width).predict(x)
        for replicas in args.replicas:
            dep = serve.deployment(
                Model,
                name="model",
                num_replicas=replicas,
                max_ongoing_requests=args.concurrency,
                ray_actor_options={"num_cpus": 0},
            )
            t = clock()
            handle = serve.run(dep.bind(args.width), name="bench", route_prefix=None)
            if handle.predict.remote(x).result() != expected:
                raise RuntimeError(
                    "Ray Serve's replica answered something else than the local model"
                )
            out[f"deploy_{replicas}"] = clock() - t
            for n in args.inflight:
                log(f"ray serve: {replicas} replica(s), {n} in flight")
                out["rows"][f"{replicas}x{n}"] = drive(
                    lambda h=handle: h.predict.remote(x).result(), n, args.seconds, args.warmup
                )
            serve.delete("bench")
        if args.cold:
            out["cold"] = ray_cold(serve, x, args)
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def ray_cold(serve: Any, x: Any, args: argparse.Namespace) -> dict[str, float]:
    """min_replicas=0: wait for 0 running replicas, then time the first call and the next."""
    dep = serve.deployment(
        Model,
        name="cold",
        max_ongoing_requests=args.concurrency,
        ray_actor_options={"num_cpus": 0},
        autoscaling_config={
            "min_replicas": 0,
            "initial_replicas": 1,
            "max_replicas": 1,
            "downscale_delay_s": 1,
            "upscale_delay_s": 0,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2,
        },
    )
    handle = serve.run(dep.bind(args.width), name="cold", route_prefix=None)
    handle.predict.remote(x).result()
    log("ray serve: waiting for 0 replicas")
    deadline = clock() + 90
    while clock() < deadline:
        states = serve.status().applications["cold"].deployments["cold"].replica_states
        if not any(states.values()):
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"Ray Serve did not scale to zero in 90 s: {states}")
    t = clock()
    handle.predict.remote(x).result()
    cold = clock() - t
    t = clock()
    handle.predict.remote(x).result()
    return {"cold": cold, "warm": clock() - t}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["floor", "ray"])
    p.add_argument("--width", type=int, default=WIDTH)
    p.add_argument("--parent-pid", type=int, default=os.getppid())
    p.add_argument("--out")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--inflight", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--cold", action="store_true", help="ray: also time a call after scale-to-zero")
    args = p.parse_args()
    if args.what == "floor":
        serve_floor(args.width, args.parent_pid)
        return
    if not args.out:
        p.error("ray needs --out")
    result = run_ray(args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
