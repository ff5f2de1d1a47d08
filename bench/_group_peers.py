"""Peer side of ``bench/bench_groups.py``: the same worker-group calls on Ray or Monarch, run
in its own process (and usually its own venv: ``--peer-python``), so that neither runtime
shares a process with ktlite or with the other. Writes a JSON object of samples (seconds)
to ``--out``.

    python bench/_group_peers.py ray --out /tmp/ray.json
    python bench/_group_peers.py monarch --iters 100 --out /tmp/monarch.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
clock = time.perf_counter
SLEEP_S = 0.010


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
    """Wall seconds of ``fn`` (one batch of calls), after one warm-up batch."""
    fn()
    out = []
    for _ in range(n):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def run_ray(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    most = max([1, *args.fanout, args.perrank])
    ray.init(address="local", num_cpus=max(most, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    try:
        @ray.remote(num_cpus=0)
        class Worker:
            def noop(self) -> None:
                return None

            def nap(self) -> None:
                time.sleep(SLEEP_S)

            def take(self, data: bytes) -> int:
                return len(data)

        actors = [Worker.remote() for _ in range(most)]
        ray.get([a.noop.remote() for a in actors])
        server = Worker.options(max_concurrency=args.concurrency).remote()
        ray.get(server.noop.remote())
        out: dict[str, Any] = {"version": ray.__version__}
        one = actors[0]
        out["single"] = loop(lambda: ray.get(one.noop.remote()), args.iters, args.warmup)
        for n in args.fanout:
            group = actors[:n]
            out[f"fanout_{n}"] = loop(lambda g=group: ray.get([a.noop.remote() for a in g]),
                                      args.iters, args.warmup)
        n = args.submit
        out["submit_noop"] = rounds(lambda: ray.get([server.noop.remote() for _ in range(n)]), args.rounds)
        out["submit_nap"] = rounds(lambda: ray.get([server.nap.remote() for _ in range(n)]), args.rounds)
        shards = [os.urandom(args.perrank_bytes) for _ in range(args.perrank)]
        group = actors[:args.perrank]
        out["perrank"] = loop(lambda: ray.get([a.take.remote(s) for a, s in zip(group, shards, strict=True)]),
                              max(10, args.iters // 4), max(3, args.warmup // 4))
        return out
    finally:
        ray.shutdown()


def run_monarch(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import version

    from monarch.actor import Actor, endpoint, this_host

    class Worker(Actor):
        @endpoint
        def noop(self) -> None:
            return None

        @endpoint
        def take(self, data: bytes) -> int:
            return len(data)

    class Napper(Actor):  # Monarch keeps async endpoints apart from sync ones
        @endpoint
        async def nap(self) -> None:  # async: Monarch interleaves these on the actor's loop
            await asyncio.sleep(SLEEP_S)

        @endpoint
        async def noop(self) -> None:
            return None

    most = max([1, *args.fanout, args.perrank])
    procs = this_host().spawn_procs(per_host={"procs": most})
    try:
        mesh = procs.spawn("worker", Worker)
        mesh.noop.call().get()
        out: dict[str, Any] = {"version": version("torchmonarch")}
        one = mesh.slice(procs=0)
        out["single"] = loop(lambda: one.noop.call_one().get(), args.iters, args.warmup)
        for n in args.fanout:
            part = mesh if n == most else mesh.slice(procs=slice(0, n))
            out[f"fanout_{n}"] = loop(lambda p=part: p.noop.call().get(), args.iters, args.warmup)
        n = args.submit

        napper = procs.slice(procs=0).spawn("napper", Napper)
        napper.noop.call_one().get()

        def batch(method: str) -> None:
            target = one if method == "noop" else napper
            futures = [getattr(target, method).call_one() for _ in range(n)]
            for f in futures:
                f.get()

        out["submit_noop"] = rounds(lambda: batch("noop"), args.rounds)
        out["submit_nap"] = rounds(lambda: batch("nap"), args.rounds)
        shards = [os.urandom(args.perrank_bytes) for _ in range(args.perrank)]
        ranks = [mesh.slice(procs=i) for i in range(args.perrank)]

        def perrank() -> None:
            futures = [r.take.call_one(s) for r, s in zip(ranks, shards, strict=True)]
            for f in futures:
                f.get()

        out["perrank"] = loop(perrank, max(10, args.iters // 4), max(3, args.warmup // 4))
        return out
    finally:
        procs.stop().get()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["ray", "monarch"])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--fanout", type=int, nargs="*", default=[4, 8])
    p.add_argument("--submit", type=int, default=100, help="calls per throughput batch")
    p.add_argument("--rounds", type=int, default=5, help="throughput batches")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--perrank", type=int, default=8, help="ranks of the per-rank-data call")
    p.add_argument("--perrank-bytes", type=int, default=1_000_000)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = run_ray(args) if args.engine == "ray" else run_monarch(args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
