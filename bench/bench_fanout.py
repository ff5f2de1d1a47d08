"""The per-pod cost of a fan-out (issue 26, item 2): 8 ranks on 8 pods against 8 ranks on one
pod, and against Monarch's 8-proc mesh, on this machine.

    python bench/bench_fanout.py [--rounds 3] [--calls 30]

Rows (p50 and p99 of ``--calls`` warm no-op calls per round; the median of the rounds' p50s,
with their spread, and the p99 over every round's calls):

- ktlite 1 pod x 8 ranks: ``kt.fn(noop).to(Compute().distribute("spmd", num_proc=8))``;
- ktlite 8 pods x 1 rank: ``distribute("spmd", workers=8)``, flat (pod 0 calls the 7 others);
- ktlite 8 pods x 1 rank, tree of 2: ``tree_fanout=2, tree_minimum=2`` (pod 0 calls 2 pods,
  each relays to 2 or 3 more): the call tree's cost at a size where it is not used;
- ktlite 1 pod x 64 ranks (with ``--ranks64``): ``distribute("spmd", num_proc=64)``, whose
  p99 has the issue-26 target of 10 ms;
- Monarch 8-proc mesh: a controller process attached to one ``run_worker_loop_forever``
  host (unix socket) that spawned 8 procs with an actor each, calling an endpoint on all 8
  (``actors.ping.call().get()``), by hand.

Everything is real: local pod server processes and rank processes, Monarch's own processes.
Each round measures every row once, the order rotated between rounds; the load average is
printed before and after. The issue-26 targets: 8 pods x 1 rank <= 0.7x Monarch's 8-proc mesh;
64 ranks on one pod p99 <= 10 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

if __name__ == "__main__":
    _HOME = tempfile.mkdtemp(prefix="ktlite-bench-fanout-")
    os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests'
    os.environ.pop("KTLITE_BACKEND", None)

from _rounds import loadavg  # noqa: E402

import ktlite as kt  # noqa: E402

clock = time.perf_counter
TARGET = 0.7
TARGET_P99_64_MS = 10.0


def noop() -> None:
    return None


WORKER = (
    "import sys; from monarch.actor import run_worker_loop_forever; "
    "run_worker_loop_forever(address=sys.argv[1], ca='trust_all_connections')"
)
DRIVER = """
import json, sys, time
from monarch.actor import Actor, attach_to_workers, endpoint

class Pinger(Actor):
    @endpoint
    def ping(self) -> int:
        return 1

hosts = attach_to_workers(ca="trust_all_connections", workers=[sys.argv[1]])
procs = hosts.spawn_procs(per_host={"gpus": 8})
actors = procs.spawn("pinger", Pinger)
assert sum(v for _, v in actors.ping.call().get().items()) == 8
print("READY", flush=True)
for line in sys.stdin:  # one round per line: the number of calls
    times = []
    for _ in range(int(line)):
        t0 = time.perf_counter()
        actors.ping.call().get()
        times.append(time.perf_counter() - t0)
    print("TIMES " + json.dumps(times), flush=True)
procs.stop().get()
"""


class MonarchMesh:
    """One worker loop and a controller with 8 procs, kept for every round."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ktmon-f")
        address = f"ipc://{self.dir}/0"
        self.worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, address],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = clock() + 60
        while True:
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(address[len("ipc://") :])
                break
            if clock() > deadline:
                raise TimeoutError(f"Monarch's worker loop did not listen at {address} in 60 s")
            time.sleep(0.01)  # polling a socket another process opens, bounded above
        self.driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.driver.stdout is not None
        for line in self.driver.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise RuntimeError(f"Monarch's controller exited ({self.driver.wait()}) before {prefix}")

    def calls(self, n: int) -> list[float]:
        assert self.driver.stdin is not None
        self.driver.stdin.write(f"{n}\n")
        self.driver.stdin.flush()
        return [float(x) for x in json.loads(self._expect("TIMES "))]

    def close(self) -> None:
        for p in (self.driver, self.worker):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _p99(xs: list[float]) -> float:
    """The nearest-rank 99th percentile."""
    ordered = sorted(xs)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def _timed(fn: Any, n: int) -> list[float]:
    fn()
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--ranks64", action="store_true", help="add 1 pod x 64 ranks (p99 target)")
    args = p.parse_args()
    shapes = {
        "ktlite 1 pod x 8 ranks": kt.Compute(cpus=0.5).distribute("spmd", num_proc=8),
        "ktlite 8 pods x 1 rank": kt.Compute(cpus=0.5).distribute("spmd", workers=8),
        "ktlite 8 pods x 1 rank, tree of 2": kt.Compute(cpus=0.5).distribute(
            "spmd", workers=8, tree_fanout=2, tree_minimum=2
        ),
    }
    if args.ranks64:
        shapes["ktlite 1 pod x 64 ranks"] = kt.Compute(cpus=0.5).distribute("spmd", num_proc=64)
    load = [loadavg()]
    runners: dict[str, Any] = {}
    remotes: list[Any] = []
    mesh = None
    try:
        for i, (name, compute) in enumerate(shapes.items()):
            remote = kt.fn(noop, name=f"bench-fanout-{i}").to(compute)
            remotes.append(remote)
            runners[name] = lambda r=remote: _timed(r, args.calls)
        try:
            mesh = MonarchMesh()
            runners["Monarch 8-proc mesh"] = lambda: mesh.calls(args.calls)
        except Exception as e:  # noqa: BLE001 - ktlite's rows still run
            print(f"Monarch's mesh did not start: {type(e).__name__}: {e}", file=sys.stderr)
        p50s: dict[str, list[float]] = {name: [] for name in runners}
        every: dict[str, list[float]] = {name: [] for name in runners}
        names = list(runners)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times = [t * 1000 for t in runners[name]()]
                p50s[name].append(statistics.median(times))
                every[name] += times
        load.append(loadavg())
    finally:
        if mesh is not None:
            mesh.close()
        for remote in remotes:
            with contextlib.suppress(Exception):
                remote.teardown()
    print(f"load before/after: {load[0]} / {load[1]}; {os.cpu_count()} cores")
    print(f"{'shape':<38} {'p50 ms':>8} {'p99 ms':>8}  rounds' p50 ms")
    for name, xs in p50s.items():
        spread = ", ".join(f"{x:.2f}" for x in xs)
        print(f"{name:<38} {statistics.median(xs):>8.2f} {_p99(every[name]):>8.2f}  [{spread}]")
    flat = statistics.median(p50s["ktlite 8 pods x 1 rank"])
    one = statistics.median(p50s["ktlite 1 pod x 8 ranks"])
    print(
        f"\nper extra pod: {(flat - one) / 7:.3f} ms (8 pods x 1 rank minus 1 pod x 8 ranks, / 7)"
    )
    if "Monarch 8-proc mesh" in p50s:
        mon = statistics.median(p50s["Monarch 8-proc mesh"])
        ratio = flat / mon
        verdict = "met" if ratio <= TARGET else "not met"
        print(
            f"- 8 pods x 1 rank vs Monarch's 8-proc mesh: {ratio:.2f}x (target <= {TARGET}x): "
            f"{verdict}"
        )
        if verdict == "not met":
            print(
                f"  cause: 17 processes share {os.cpu_count()} cores and the call's CPU bounds "
                "its time (~2.6 ms of it on 2 cores): each member pod server ~170 us a call "
                "(the link's read, the RUN's checks, the rank hand-off, the DONE; two wake-ups), "
                "pod 0 ~90 us per member, each rank ~60 us (bench/README.md, one-rank pods: a "
                "call started where it was read)"
            )
    if "ktlite 1 pod x 64 ranks" in every:
        p99 = _p99(every["ktlite 1 pod x 64 ranks"])
        verdict = "met" if p99 <= TARGET_P99_64_MS else "not met"
        print(
            f"- 1 pod x 64 ranks p99: {p99:.2f} ms (target <= {TARGET_P99_64_MS:g} ms): {verdict}"
        )
        if verdict == "not met":
            print(
                f"  cause: 64 rank processes and the pod server share {os.cpu_count()} cores: "
                "each rank's ~0.11 M instructions a call (three quarters in the interpreter) "
                "are most of the call's CPU; the messages are written in one pass and the ranks "
                "woken by one ring (bench/README.md, 64 ranks on one pod)"
            )


if __name__ == "__main__":
    main()
