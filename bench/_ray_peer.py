"""Reference peer: Ray actor calls, run in its own process so Ray's runtime never shares
the benchmark's process. Writes a JSON object of samples (seconds) to ``--out``.

    python bench/_ray_peer.py --iters 300 --warmup 30 --fanout 2 4 --out /tmp/ray.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def _loop(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    gc.collect()
    out = []
    clock = time.perf_counter
    for _ in range(iters):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--fanout", type=int, nargs="*", default=[4])
    p.add_argument("--out", required=True)
    p.add_argument("--temp-dir", default=None, help="Ray's session directory (default: Ray's own)")
    args = p.parse_args()

    import ray

    result: dict[str, object] = {"ray_version": ray.__version__}
    t0 = time.perf_counter()
    most = max([1, *args.fanout])
    ray.init(address="local", num_cpus=max(most, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False, logging_level="ERROR",
             **({"_temp_dir": args.temp_dir} if args.temp_dir else {}))
    try:
        @ray.remote(num_cpus=0)
        class Actor:
            def f(self) -> None:
                return None

        actors = [Actor.remote() for _ in range(most)]
        ray.get([a.f.remote() for a in actors])
        result["init_s"] = time.perf_counter() - t0
        one = actors[0]
        result["actor_call"] = _loop(lambda: ray.get(one.f.remote()), args.iters, args.warmup)
        for n in args.fanout:
            group = actors[:n]
            result[f"fanout_{n}"] = _loop(lambda g=group: ray.get([a.f.remote() for a in g]),
                                          args.iters, args.warmup)
    finally:
        ray.shutdown()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
