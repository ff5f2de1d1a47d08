"""Reference peer of ``bench.py``: Ray actor calls, in a process of its own so that Ray's
runtime never shares the benchmark's process. Started once (``ray.init`` + the actors; its
ready reply carries ``ray_version`` and ``init_s``), then asked for one round at a time over
``_peer_link`` (``actor_call``, ``fanout``), each returning its samples in seconds.

    PeerProcess("Ray", [python, "bench/_ray_peer.py", "--actors", "4"], start_timeout=300)
"""

from __future__ import annotations

import argparse
import os
import time

from _peer_link import open_replies
from _rounds import timed_calls

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--temp-dir", default=None, help="Ray's session directory (default: Ray's own)")
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args()
    replies = open_replies(args.reply_fd)

    import ray

    t0 = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=max(args.actors, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        **({"_temp_dir": args.temp_dir} if args.temp_dir else {}),
    )
    try:

        @ray.remote(num_cpus=0)
        class Actor:
            def f(self) -> None:
                return None

        actors = [Actor.remote() for _ in range(args.actors)]
        ray.get([a.f.remote() for a in actors])
        init_s = time.perf_counter() - t0
        one = actors[0]

        def actor_call(iters: int, warmup: int) -> list[float]:
            return timed_calls(lambda: ray.get(one.f.remote()), iters, warmup)

        def fanout(n: int, iters: int, warmup: int) -> list[float]:
            group = actors[:n]
            return timed_calls(lambda: ray.get([a.f.remote() for a in group]), iters, warmup)

        replies.serve(
            {"ray_version": ray.__version__, "init_s": init_s},
            {"actor_call": actor_call, "fanout": fanout},
        )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
