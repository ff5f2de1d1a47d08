"""A thousand pods × 8 ranks on this machine: ktlite's client and pod servers at 8 to 1,000
simulated pods (issue 26, item 1), with the call tree (item 2).

    python bench/bench_scale.py                       # 1 (the baseline), 8, 64, 256, 1,000 pods
    python bench/bench_scale.py --pods 8,64 --calls 30
    python bench/bench_scale.py --pods 64,256 --tree flat      # or 8: tree_fanout=8 from 2 pods

What is real and what is simulated:

- real: the client (``kt.cls(...).to(...)``, the ``Fanout`` mode, call plans, the HTTP client,
  results in rank order, streamed log lines, ``Future.cancel``); every pod server (the
  ``ktlite_server`` app behind its admission gate and connection guard, one listening socket
  per pod, the coordinator and its peers, the call tree's relays, streams, the code push and
  its relays, launches, the pod runtime ``Pod`` with its gate, heals and per-call handling);
  loopback TCP between all of them;
- simulated: where the pods run and what a rank is. The pods are spread over a few host
  processes (``_sim_host.py``, 250 pods each) instead of one process (and one machine) each,
  so all of them share this machine's cores: the whole fan-out's server work, which a cluster
  spreads over N machines, is done here by two cores. A rank is ``_sim_rank.SimRank``: the
  rank runtime's contract (load the cloudpickled class, decode each call, run the method,
  encode its value or error, hand printed lines to the pod) run inline in its pod server's
  process, behind the seam real rank processes use (``Pod.rank_type``): no process, pipes,
  socketpair or ``torch.distributed``. The backend (``_sim_backend.SimBackend``) starts the
  hosts and reports the pods; values travel in HTTP bodies, as on Kubernetes and SSH (no
  shared memory).

Rows: ``.to() s`` the first ``.to()`` (hosts started: simulated, then the code pushed);
``push s`` a second ``.to()`` of new code to the running pods (the launch, sent once to
pod 0 and relayed to every pod, each loading it on 8 ranks; ``push: pods CPU s`` what the
pods spent on it); ``no-op p50/p99 ms`` a call of
a method that returns None; ``1 KB p50 ms`` each rank returns 1 KB; ``per-rank ms`` a
``.each()`` with one small item per rank (checked back in rank order); ``logs ms`` every rank
prints one line (all counted at the caller); ``cancel s`` from ``Future.cancel()`` to the
call ended with every rank stopped and reported (``cancel: pods CPU s``: what the pods spent
on that call, its start and its stop); ``dead pod s`` from an inner pod's death (its
connections reset, as a killed process's) to the call's error naming it; ``client CPU
ms/call`` this process's CPU per no-op call; ``pod 0 CPU ms/call`` the CPU of pod 0 (in a host
process of its own) per no-op call: the coordinator's share, on a cluster its own machine's;
``pod 1 CPU ms/call`` the same of pod 1, also alone in its host (in a tree, a relay; flat,
a member); ``serial CPU ms/call`` the call's CPU on its longest path, what a cluster spends
one step after another: the client's, pod 0's, pod 1's once per relay level below pod 0, and
a member's (what the pods spent less pod 0's and the relays', each counted as pod 1's, over
the members); ``all pods CPU ms/call`` every host process's, i.e. the server work a cluster spreads over its
machines and this machine's two cores do in turn; ``push: serial CPU ms`` the push's CPU on
its longest path, as the call's; ``path p50/p99 ms`` the no-op call's longest path measured
with its processes unthrottled (``_scale_path.py``: the client, pod 0 and pod 1 pinned to one
core, pod 1's leaves to the other, every other pod at nice 19; the wall time less pod 0's and
pod 1's idle wait for the branches off the path, ``path: idle taken out ms``; ``path: its
wall p50 ms`` the same calls' plain wall time; ``--no-path`` skips it); ``client MB`` this
process's resident memory after the size (peak in parentheses). The pods' CPU is read from
``/proc/PID/task/*/schedstat`` (nanoseconds), the client's from ``time.process_time``.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-scale-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests' deployments
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
sys.path.insert(0, str(HERE))

import _scale_path  # noqa: E402
import _sim_backend  # noqa: E402
from _rounds import loadavg  # noqa: E402
from _scale_report import PROCS, table, verdicts  # noqa: E402
from _scale_workload import Workload  # noqa: E402

import ktlite as kt  # noqa: E402
from ktlite.specs.spec import TREE_FANOUT, TREE_MINIMUM  # noqa: E402
from ktlite_wire import calltree  # noqa: E402


class Lines(io.TextIOBase):
    """A stdout that counts the streamed lines holding ``marker`` (the caller's rank output)."""

    def __init__(self) -> None:
        self.count = 0
        self.marker = ""
        self._cv = threading.Condition()

    def write(self, text: str) -> int:
        with self._cv:
            self.count += text.count(self.marker) if self.marker else 0
            self._cv.notify_all()
        return len(text)

    def expect(self, marker: str) -> None:
        with self._cv:
            self.marker, self.count = marker, 0

    def wait(self, n: int, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.count >= n, timeout)


def _cpu(pids: list[int]) -> float:
    """CPU seconds of these processes so far: each thread's time on a CPU in nanoseconds
    (``/proc/PID/task/TID/schedstat``; the clock ticks of ``/proc/PID/stat`` are 10 ms, too
    coarse for a few milliseconds per call)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total / 1e9


def _rss_mb() -> tuple[float, float]:
    now = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            now = int(line.split()[1]) / 1024
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(
    pods: int,
    calls: int,
    tree: dict[str, int],
    lines: Lines,
    backend: Any,
    profile: str = "",
    path: bool = True,
) -> dict[str, Any]:
    name = f"scale-{pods}"
    world = pods * PROCS
    compute = kt.Compute(cpus=1, stream_logs=False).distribute(
        "spmd", workers=pods, num_proc=PROCS, **tree
    )
    row: dict[str, Any] = {"pods": pods, "ranks": world, "load_before": loadavg()}
    fanout = compute.distributed.tree(pods)
    row["tree"] = f"{fanout} (depth {calltree.depth(pods, fanout)})" if fanout else "flat"
    t0 = time.perf_counter()
    remote = kt.cls(Workload, name=name).to(compute)
    row["to_s"] = time.perf_counter() - t0
    try:
        hosts = backend.deployments[name]
        host_pids = [p.pid for p in hosts.procs]
        pushed = sorted({0, 1, pods - 1})[: min(3, pods)]  # pod 0, a relay, a member's host
        if profile:
            for ordinal in pushed:
                hosts.profile(ordinal, None)
        pod1 = host_pids[1:2] if pods > 2 else []  # pod 1 alone in its host
        t0, cpu0, own0 = time.perf_counter(), _cpu(host_pids), time.process_time()
        root0, one0 = _cpu(host_pids[:1]), _cpu(pod1)
        remote = kt.cls(Workload, name=name).to(compute, init_args={"tag": "again"})
        row["push_s"] = time.perf_counter() - t0
        row["push_cpu_s"] = _cpu(host_pids) - cpu0
        if pod1:  # the push's CPU on its longest path, as a call's below
            row["push_serial_cpu_ms"] = 1000 * _serial_cpu(
                time.process_time() - own0,
                _cpu(host_pids[:1]) - root0,
                _cpu(pod1) - one0,
                row["push_cpu_s"],
                pods,
                fanout,
            )
        if profile:
            for ordinal in pushed:
                path = f"{profile}/push-pod{ordinal}-{pods}.prof"
                hosts.profile(ordinal, path)
                hosts.profiled(path)
                _report_profile(path, path, f"the host of pod {ordinal}, the code push")
        assert remote.tag() == ["again"] * world
        _timed(remote.noop, 3)  # warm connections
        if profile:
            for ordinal in (0, 1)[: min(2, pods - 1)]:  # pod 0's host, and pod 1's (alone)
                hosts.profile(ordinal, None)
            own = cProfile.Profile(time.thread_time)  # CPU of the calling thread
            own.enable()
        cpu0, root0, own0 = _cpu(host_pids), _cpu(host_pids[:1]), time.process_time()
        one0 = _cpu(pod1)
        lat = _timed(remote.noop, calls)
        row["client_cpu_ms"] = (time.process_time() - own0) / calls * 1000
        row["host_cpu_ms"] = (_cpu(host_pids) - cpu0) / calls * 1000
        row["pod0_cpu_ms"] = (_cpu(host_pids[:1]) - root0) / calls * 1000
        row["pod1_cpu_ms"] = (_cpu(pod1) - one0) / calls * 1000 if pod1 else None
        if pod1:  # the call's CPU on its longest path: what a cluster does one after another
            row["serial_cpu_ms"] = _serial_cpu(
                row["client_cpu_ms"],
                row["pod0_cpu_ms"],
                row["pod1_cpu_ms"],
                row["host_cpu_ms"],
                pods,
                fanout,
            )
        row["noop_p50_ms"], row["noop_p99_ms"] = _pct(lat, 0.5), _pct(lat, 0.99)
        if profile:
            own.disable()
            _report_profile(
                own, f"{profile}/client-{pods}.prof", f"the client, {calls} no-op calls"
            )
            for ordinal in (0, 1)[: min(2, pods - 1)]:
                path = f"{profile}/pod{ordinal}-{pods}.prof"
                hosts.profile(ordinal, path)
                hosts.profiled(path)
                _report_profile(path, path, f"pod {ordinal}'s host, {calls} no-op calls")
        if path:
            row.update(_scale_path.measure(remote.noop, hosts, pods, calls, _HOME))
        kb = _timed(lambda: _check(remote.kilobyte(), [b"x" * 1024] * world), max(3, calls // 4))
        row["kb_p50_ms"] = _pct(kb, 0.5)
        items = list(range(world))
        each = _timed(lambda: _check(remote.echo.each(items), items), max(3, calls // 4))
        row["each_p50_ms"] = _pct(each, 0.5)
        quiet = sys.stdout
        sys.stdout = lines
        try:
            lines.expect("says hello")
            t0 = time.perf_counter()
            remote.say.options(stream_logs=True)()
            row["logs_ms"] = (time.perf_counter() - t0) * 1000
            row["log_lines"] = f"{lines.count}/{world}"
            cpu0 = _cpu(host_pids)
            row["cancel_s"] = _cancel(remote, lines, world)
            row["cancel_cpu_s"] = _cpu(host_pids) - cpu0  # the long call's start, and its stop
            row["dead_s"], row["dead_named"] = _dead(remote, lines, world, hosts, fanout)
        finally:
            sys.stdout = quiet
    finally:
        remote.teardown()
    row["client_mb"], row["client_peak_mb"] = _rss_mb()
    row["load_after"] = loadavg()
    return row


def _relays(pods: int, fanout: int) -> int:
    """How many pods of a call tree relay the call to others (pod 0 not counted)."""
    todo, relays = calltree.split(list(range(1, pods)), fanout) if fanout else [], 0
    while todo:
        sub = todo.pop()
        if len(sub) > 1:
            relays += 1
            todo += calltree.split(sub[1:], fanout)
    return relays


def _serial_cpu(
    client: float, pod0: float, pod1: float, every_pod: float, pods: int, fanout: int
) -> float:
    """The CPU of a call (or a push) on its longest path: the client, pod 0, a relay per level
    below it (pod 1, measured alone; flat, pod 1 is a member like any other) and a member,
    whose share is what the pods spent (``every_pod``) less pod 0's and the relays' (taken as
    pod 1's each)."""
    relays = _relays(pods, fanout)
    levels = calltree.depth(pods, fanout) - 1 if fanout else 0
    members = pods - 1 - relays
    member = (every_pod - pod0 - pod1 * relays) / members if relays else pod1
    return float(client + pod0 + pod1 * levels + max(member, 0.0))


def _report_profile(prof: Any, path: str, what: str) -> None:
    """Write a cProfile's stats to ``path`` and its top functions (own time) to stderr."""
    stats = pstats.Stats(prof, stream=sys.stderr)
    stats.dump_stats(path)
    print(f"--- profile of {what} ({path}), by own time:", file=sys.stderr)
    stats.sort_stats("tottime").print_stats(18)


def _check(got: Any, want: Any) -> None:
    if got != want:
        raise AssertionError(f"wrong values: {str(got)[:200]} (want {str(want)[:200]})")


def _started(remote: Any, lines: Lines, world: int) -> Any:
    lines.expect("holds")
    future = remote.hold.options(stream_logs=True).submit(300.0)
    if not lines.wait(world, 300.0):
        raise RuntimeError(f"only {lines.count} of {world} ranks started the long call")
    return future


def _cancel(remote: Any, lines: Lines, world: int) -> float:
    future = _started(remote, lines, world)
    t0 = time.perf_counter()
    future.cancel()
    with contextlib.suppress(concurrent.futures.CancelledError):
        future.exception(120.0)
    return time.perf_counter() - t0


def _dead(remote: Any, lines: Lines, world: int, hosts: Any, fanout: int) -> tuple[float, bool]:
    """Kill an inner pod (pod 1: in a tree, the relay of a subtree) mid-call."""
    future = _started(remote, lines, world)
    victim = 1 if len(hosts.ports) > 1 else 0
    t0 = time.perf_counter()
    hosts.kill_pod(victim)
    error = future.exception(120.0)
    took = time.perf_counter() - t0
    return took, error is not None and f"scale-{len(hosts.ports)}-{victim}" in str(error)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pods", default="1,8,64,256,1000")
    p.add_argument("--calls", type=int, default=100, help="no-op calls per size")
    p.add_argument("--tree", default="default", help="default, flat, or a fan-out (from 2 pods)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--profile",
        default="",
        metavar="DIR",
        help="cProfile the client, pod 0's and pod 1's hosts over the no-op calls (from 2 pods), stats "
        "to DIR; that run's times and CPU columns include the profiler's cost",
    )
    p.add_argument(
        "--no-path",
        action="store_true",
        help="skip the longest path's measure (_scale_path.py: pinned cores, a timeline)",
    )
    args = p.parse_args()
    tree: dict[str, int] = {}
    if args.tree == "flat":
        tree = {"tree_minimum": 1 << 30}
    elif args.tree != "default":
        tree = {"tree_fanout": int(args.tree), "tree_minimum": 2}
    backend = _sim_backend.install()
    lines = Lines()
    rows = []
    print(
        f"bench_scale: {os.cpu_count()} cores, load {loadavg()}, tree {args.tree} "
        f"(defaults: fan-out {TREE_FANOUT} from {TREE_MINIMUM} pods)",
        file=sys.stderr,
    )
    for pods in (int(x) for x in args.pods.split(",")):
        row = measure(
            pods,
            args.calls,
            tree,
            lines,
            backend,
            args.profile if pods > 1 else "",
            path=not args.no_path,
        )
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(table(rows))
    print()
    for line in verdicts(rows):
        print("- " + line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
