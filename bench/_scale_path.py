"""The no-op call's longest path at up to 1,000 simulated pods, measured on a 2-core machine
(``bench_scale.py``'s ``path`` columns).

The wall time of a call at 1,000 pods here is the 1,000 pod servers' CPU summed on two cores;
a cluster runs them side by side, each on its own machine, and what it waits for is the
call's longest path: the client, pod 0, one relay (pod 1), one of the pods it relays to, and
back. This measures that path with every process on it real and unthrottled, and counts what
the rest cost apart:

- placement: the client, pod 0's host and pod 1's host (each alone in its process) run on one
  core, the host of the pods pod 1 relays to on the other; every other host on either core at
  nice 19, so the path's processes are not queued behind them (Linux gives a nice-0 task about
  98% of a core it shares with nice-19 ones, and lets it preempt them when it wakes), while
  they take whatever the path leaves idle. Other work on the machine (other sessions' at nice
  0) is not placed: the run's load says how much there was;
- timeline: pod 0's and pod 1's hosts note when each child's answer arrived, and when the
  probes of the children before the call began and answered (the machine's monotonic clock,
  shared by every process, and the loop thread's CPU time then: ``_sim_host.py timeline``);
- the path's time of a call: its wall time at the caller, less the time pod 0 sat idle after
  pod 1's answer arrived waiting for its other children's, and the time pod 1 sat idle after
  the first of its children's answers waiting for the others', and the same for the probes of
  the children that precede a call whose connections sat idle over 2 s (``peers.ensure``:
  every call here, where the pods off the path take seconds; on a cluster, calls back to back
  skip them). Idle is wall time less the
  thread's CPU: what pod 0 and pod 1 spent on the other answers as they came (each is read
  once, as on a cluster) stays in. That is the call as a cluster would run it if every branch
  took as long as pod 1's (the tree's branches are alike: the same fan-out, the same work per
  pod); the other branches' CPU is reported as the hosts' CPU.

At one pod, the path is the call (the client and pod 0 on one core). Flat (no tree), pod 1 is
a member, and the path is pod 0 and pod 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

NICE_REST = 19


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


@contextlib.contextmanager
def placed(path_pids: list[int], leaf_pids: list[int], rest_pids: list[int]) -> Iterator[bool]:
    """Pin ``path_pids`` (every thread) to one core and ``leaf_pids`` to another; ``rest_pids``
    at nice 19 on any; put every thread back as it was on exit. Yields False (nothing changed)
    on a machine with fewer than 2 usable cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        yield False
        return
    before: dict[int, tuple[set[int], int]] = {}  # by process: its main thread's
    plan = [(path_pids, {cores[0]}, 0), (leaf_pids, {cores[1]}, 0)]
    plan += [(rest_pids, set(cores), NICE_REST)]
    try:
        for pids, cpus, nice in plan:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    before[pid] = (os.sched_getaffinity(pid), os.getpriority(os.PRIO_PROCESS, pid))
                _set(pid, cpus, nice)
        yield True
    finally:  # every thread as its process was, those started meanwhile too
        for pid, (cpus, nice) in before.items():
            _set(pid, cpus, nice)


def _set(pid: int, cpus: set[int], nice: int) -> None:
    """Every thread of ``pid``: on ``cpus``, at ``nice`` (Linux keeps both per thread)."""
    for tid in _tasks(pid):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def _idle(arrivals: list[tuple[float, float]], after: float, cpu_after: float) -> float:
    """Seconds a coordinator sat idle from ``after`` to its last child's answer."""
    last_t, last_cpu = max(arrivals)
    return max(0.0, (last_t - after) - (last_cpu - cpu_after))


def path_times(
    calls: list[tuple[float, float]], records: list[list[Any]]
) -> list[tuple[float, float]]:
    """Each call's (wall, path) seconds from the caller's (start, end) and the hosts' records
    (``[call id, pod, what, child, monotonic, cpu]``, ``_sim_host.py``): the wall time less
    pod 0's idle wait after pod 1's answer (pod 1's: after its first child's), and the same
    for the probes of the children before the call (``Coordinator._quorum``, when their
    connections were idle longer than ``peers.PROBE_AFTER_S``: every call, where the pods off
    the path take seconds)."""
    by_call: dict[str, list[list[Any]]] = defaultdict(list)
    for record in records:
        by_call[record[0]].append(record)
    out = []
    for start, end in calls:
        wall = end - start
        mine = [
            rows
            for rows in by_call.values()
            if any(r[1] == 0 and start <= r[4] <= end for r in rows)
        ]
        if not mine:  # one pod: nothing fanned out, the call is its path
            out.append((wall, wall))
            continue
        idle = 0.0
        for pod in (0, 1):
            rows = [r for r in mine[0] if r[1] == pod]
            kinds: dict[str, dict[int, tuple[float, float]]] = defaultdict(dict)
            for _, _, what, child, t, cpu in rows:
                kinds[what][child] = (t, cpu)
            answers, probes = kinds["answer"], kinds["probe"]
            # the path's child: pod 1 for pod 0; for pod 1, whichever of its own came first
            if answers and (pod == 1 or 1 in answers):
                idle += _idle(
                    list(answers.values()), *(answers[1] if pod == 0 else min(answers.values()))
                )
            if probes:
                began = kinds["quorum"].get(-1, min(probes.values()))
                path = probes.get(1) if pod == 0 else min(probes.values())
                idle += _idle(list(probes.values()), *(path or began))
        out.append((wall, wall - idle))
    return out


def measure(
    call: Callable[[], Any], hosts: Any, pods: int, calls: int, work_dir: str
) -> dict[str, Any]:
    """The path's p50/p99 (ms) of ``calls`` calls of ``call`` with the placement above, the
    same calls' wall time, and how much idle waiting was taken out (median)."""
    on_path = [0, 1] if pods > 1 else [0]
    path_pids = [os.getpid()] + sorted({hosts.owner[i].pid for i in on_path})
    leaf_pids = sorted({hosts.owner[i].pid for i in hosts.below_1})
    rest_pids = sorted({p.pid for p in hosts.procs} - set(path_pids) - set(leaf_pids))
    with placed(path_pids, leaf_pids, rest_pids) as ok:
        if not ok:
            return {}
        for _ in range(3):  # warm, in place
            call()
        for i in on_path:
            hosts.command(i, "timeline on")
        spans = []
        for _ in range(calls):
            t0 = time.monotonic()
            call()
            spans.append((t0, time.monotonic()))
        records: list[list[Any]] = []
        for i in on_path:
            path = os.path.join(work_dir, f"timeline-{pods}-{i}.json")
            hosts.command(i, f"timeline {path}")
            hosts.profiled(path)  # waits for the file
            with open(path) as f:
                records += json.load(f)
    times = path_times(spans, records)
    walls = sorted(w * 1000 for w, _ in times)
    paths = sorted(p * 1000 for _, p in times)
    idle = sorted((w - p) * 1000 for w, p in times)
    return {
        "path_p50_ms": _pct(paths, 0.5),
        "path_p99_ms": _pct(paths, 0.99),
        "path_wall_p50_ms": _pct(walls, 0.5),
        "path_idle_ms": _pct(idle, 0.5),
    }


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
