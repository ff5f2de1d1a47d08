"""Peer side of ``bench/bench_groups.py``: the same worker-group calls on Ray or Monarch, in a
process of its own (and usually its own venv: ``--peer-python``), so that neither runtime
shares a process with ktlite or with the other. It starts its runtime and actors once, replies
ready (with the version), then runs one round of one row per request over ``_peer_link``:

- ``single(iters, warmup)``, ``fanout(n, iters, warmup)``, ``perrank(iters, warmup)``: the
  seconds of each call;
- ``submit(method, n)``: the seconds of one batch of ``n`` calls in flight at once (``noop``
  or ``nap``), after one warm-up batch.

    PeerProcess("ray", [python, "bench/_group_peers.py", "ray"], start_timeout=300)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from _peer_link import open_replies
from _rounds import clock, timed_calls

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
SLEEP_S = 0.010

Handlers = dict[str, Callable[..., Any]]


def batch_seconds(batch: Callable[[], None]) -> float:
    """Wall seconds of one batch of calls, after a warm-up batch."""
    batch()
    t = clock()
    batch()
    return clock() - t


@contextlib.contextmanager
def ray_peer(args: argparse.Namespace) -> Iterator[tuple[dict[str, Any], Handlers]]:
    import ray

    most = max([1, *args.fanout, args.perrank])
    ray.init(
        address="local",
        num_cpus=max(most, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
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
        one = actors[0]
        shards = [os.urandom(args.perrank_bytes) for _ in range(args.perrank)]
        ranks = actors[: args.perrank]

        def submit(method: str, n: int) -> float:
            call = getattr(server, method)
            return batch_seconds(lambda: ray.get([call.remote() for _ in range(n)]))

        yield (
            {"version": ray.__version__},
            {
                "single": lambda iters, warmup: timed_calls(
                    lambda: ray.get(one.noop.remote()), iters, warmup
                ),
                "fanout": lambda n, iters, warmup: timed_calls(
                    lambda g=actors[:n]: ray.get([a.noop.remote() for a in g]), iters, warmup
                ),
                "submit": submit,
                "perrank": lambda iters, warmup: timed_calls(
                    lambda: ray.get([a.take.remote(s) for a, s in zip(ranks, shards, strict=True)]),
                    iters,
                    warmup,
                ),
            },
        )
    finally:
        ray.shutdown()


@contextlib.contextmanager
def monarch_peer(args: argparse.Namespace) -> Iterator[tuple[dict[str, Any], Handlers]]:
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
        one = mesh.slice(procs=0)
        napper = procs.slice(procs=0).spawn("napper", Napper)
        napper.noop.call_one().get()
        parts = {n: mesh if n == most else mesh.slice(procs=slice(0, n)) for n in args.fanout}
        shards = [os.urandom(args.perrank_bytes) for _ in range(args.perrank)]
        ranks = [mesh.slice(procs=i) for i in range(args.perrank)]

        def submit(method: str, n: int) -> float:
            target = one if method == "noop" else napper

            def batch() -> None:
                futures = [getattr(target, method).call_one() for _ in range(n)]
                for f in futures:
                    f.get()

            return batch_seconds(batch)

        def perrank() -> None:
            futures = [r.take.call_one(s) for r, s in zip(ranks, shards, strict=True)]
            for f in futures:
                f.get()

        yield (
            {"version": version("torchmonarch")},
            {
                "single": lambda iters, warmup: timed_calls(
                    lambda: one.noop.call_one().get(), iters, warmup
                ),
                "fanout": lambda n, iters, warmup: timed_calls(
                    lambda p=parts[n]: p.noop.call().get(), iters, warmup
                ),
                "submit": submit,
                "perrank": lambda iters, warmup: timed_calls(perrank, iters, warmup),
            },
        )
    finally:
        procs.stop().get()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["ray", "monarch"])
    p.add_argument("--fanout", type=int, nargs="*", default=[4, 8])
    p.add_argument(
        "--concurrency", type=int, default=8, help="calls the submit rows' actor runs at once"
    )
    p.add_argument("--perrank", type=int, default=8, help="ranks of the per-rank-data call")
    p.add_argument("--perrank-bytes", type=int, default=1_000_000)
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args()
    replies = open_replies(args.reply_fd)
    with (ray_peer if args.engine == "ray" else monarch_peer)(args) as (ready, handlers):
        replies.serve(ready, handlers)


if __name__ == "__main__":
    main()
