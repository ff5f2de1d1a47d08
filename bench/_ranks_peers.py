"""Peer side of ``bench/bench_ranks.py``: N processes with an actor each, started by Ray or by
Monarch, in a process of its own (usually another venv: ``--peer-python``). It starts its
runtime once, untimed (``ray.init()``; for Monarch the host mesh, by spawning and stopping one
proc), replies ready, then answers ``start(n, warm)`` once per round over ``_peer_link``:

- Ray: ``n`` actors created and one method call on each, timed to the last answer; the
  actors' worker processes are the pids their method returns (``os.getpid()`` in the actor),
  which tells them apart from Ray's daemons (GCS, raylet, agents, idle workers), which never
  answer;
- Monarch: ``this_host().spawn_procs(per_host={"gpus": n})``, an actor spawned on each and one
  endpoint call to all of them, timed to that call's answer; its processes are the ones that
  appeared below this process meanwhile.

Each answer is ``{"wall_s", "cpu_s", "pss_mib", "procs", "driver_cpu_s"}``: the CPU those
processes spent until the answer (``_proc_tree``), their PSS after ``warm`` more calls to all,
how many there were, and this process's own CPU over the same time (the driver's, apart).
The processes are stopped (and gone) before the answer is sent.

    PeerProcess("Ray", [python, "bench/_ranks_peers.py", "ray"], start_timeout=300)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from _peer_link import open_replies
from _proc_tree import cpu_seconds, descendants, pss_mib
from _rounds import clock

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Monarch's defaults give up on 64 procs started at a load of 20-40 on 2 cores ("failed to
# configure process: Timeout"); the round's own timeout bounds it instead
for _knob in ("PROC_SPAWN_MAX_IDLE", "ACTOR_SPAWN_MAX_IDLE", "ATTACH_CONFIG_TIMEOUT"):
    os.environ.setdefault(f"HYPERACTOR_MESH_{_knob}", "300s")
GONE_S = 30.0  # a stopped actor's process exits within this, or the round fails


def _gone(pids: list[int], within: float) -> None:
    """Wait until none of ``pids`` is alive (bounded); TimeoutError naming those left."""
    deadline = time.monotonic() + within
    left = pids
    while left:
        left = [p for p in left if os.path.exists(f"/proc/{p}")]
        if left and time.monotonic() > deadline:
            raise TimeoutError(f"{len(left)} stopped process(es) still alive after {within:g} s")
        time.sleep(0.05)  # polling other processes' exits, bounded above


def _self_cpu() -> float:
    return cpu_seconds([os.getpid()])


@contextlib.contextmanager
def ray_peer(most: int) -> Iterator[tuple[dict[str, Any], Callable[..., dict[str, Any]]]]:
    import ray

    temp = tempfile.mkdtemp(prefix="r")  # short: Ray's socket paths live under it
    ray.init(
        address="local",
        num_cpus=max(most, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        _temp_dir=temp,
    )
    try:

        @ray.remote(num_cpus=0)
        class Rank:
            def pid(self) -> int:
                return os.getpid()

        def start(n: int, warm: int) -> dict[str, Any]:
            driver0 = _self_cpu()
            t = clock()
            actors = [Rank.remote() for _ in range(n)]  # type: ignore[attr-defined]
            pids = ray.get([a.pid.remote() for a in actors])
            wall = clock() - t
            cpu, driver = cpu_seconds(pids), _self_cpu() - driver0
            try:
                for _ in range(warm):
                    ray.get([a.pid.remote() for a in actors])
                pss = pss_mib(pids)
            finally:
                for a in actors:
                    ray.kill(a)
                _gone(pids, GONE_S)
            return {
                "wall_s": wall,
                "cpu_s": cpu,
                "pss_mib": pss,
                "procs": len(set(pids)),
                "driver_cpu_s": driver,
            }

        yield {"version": ray.__version__}, start
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def monarch_peer(most: int) -> Iterator[tuple[dict[str, Any], Callable[..., dict[str, Any]]]]:
    from importlib.metadata import version

    from monarch.actor import Actor, endpoint, this_host

    class Rank(Actor):
        @endpoint
        def pid(self) -> int:
            return os.getpid()

    procs = this_host().spawn_procs(per_host={"gpus": 1})  # the host mesh comes up: untimed,
    procs.spawn("rank", Rank).pid.call().get()  # like ray.init()
    procs.stop().get()
    host = set(descendants(os.getpid()))  # what stays up between rounds (none seen in 0.7.0)

    def start(n: int, warm: int) -> dict[str, Any]:
        driver0 = _self_cpu()
        t = clock()
        procs = this_host().spawn_procs(per_host={"gpus": n})
        try:
            ranks = procs.spawn("rank", Rank)
            answers = ranks.pid.call().get()
            wall = clock() - t
            mine = [p for p in descendants(os.getpid()) if p not in host]
            cpu, driver = cpu_seconds(mine), _self_cpu() - driver0
            got = sorted(v for _, v in answers.items())
            if len(got) != n or not set(got) <= set(mine):
                raise RuntimeError(
                    f"Monarch answered from {len(got)} process(es), expected {n} among the "
                    f"{len(mine)} new ones below this one"
                )
            for _ in range(warm):
                ranks.pid.call().get()
            pss = pss_mib(mine)
        finally:
            procs.stop().get()
            _gone([p for p in descendants(os.getpid()) if p not in host], GONE_S)
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "pss_mib": pss,
            "procs": len(mine),
            "driver_cpu_s": driver,
        }

    yield {"version": version("torchmonarch"), "host_procs": len(host)}, start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["ray", "monarch"])
    p.add_argument("--most", type=int, default=64, help="the most ranks a round asks for")
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args()
    replies = open_replies(args.reply_fd)
    with (ray_peer if args.engine == "ray" else monarch_peer)(args.most) as (ready, start):
        replies.serve(ready, {"start": start})


if __name__ == "__main__":
    main()
