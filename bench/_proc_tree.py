"""What a tree of processes costs, read from ``/proc`` (Linux): who descends from whom, the CPU
each process has spent, and its proportional memory.

- ``descendants(root)``: every live process below ``root`` (children, theirs, ...);
- ``cpu_seconds(pids)``: the CPU time each has spent since it started, summed: the larger of
  its live threads' ``schedstat`` run times (nanoseconds) and ``utime + stime`` of its
  ``stat`` (clock ticks, but it keeps the time of threads that have ended);
- ``pss_mib(pids)``: ``Pss`` of each one's ``smaps_rollup``, summed, in MiB: shared pages
  (an interpreter's, a fork's) count once over the processes that share them.

A process that ended meanwhile counts as nothing. Standard library only: the peers' own
processes (another venv) import it too.
"""

from __future__ import annotations

import contextlib
import os

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state is the first)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def parents() -> dict[int, int]:
    """Every live process's parent pid."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # ended while we looked
                out[int(name)] = int(_stat_fields(int(name))[1])
    return out


def children(pid: int) -> list[int]:
    return [p for p, parent in parents().items() if parent == pid]


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, parents before their children."""
    kids: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        kids.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in sorted(kids.get(todo.pop(0), [])):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def parent(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def cpu_seconds(pids: list[int]) -> float:
    """The CPU the processes have spent since each started (see the module docstring)."""
    total = 0.0
    for pid in pids:
        run_ns = 0
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    run_ns += int(f.read().split()[0])
        except (OSError, ValueError):
            pass  # no schedstat here, or the process ended
        try:
            fields = _stat_fields(pid)
            ticks = int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            ticks = 0
        total += max(run_ns / 1e9, ticks * TICK_S)
    return total


def pss_mib(pids: list[int]) -> float:
    """The processes' proportional set size, summed, in MiB."""
    kib = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        kib += int(line.split()[1])
                        break
        except (OSError, ValueError):
            pass
    return kib / 1024
