"""Functions the fault-injection tests ship to rank processes (pure: imports no test code).

``act(plan, stamps, ready)`` looks up what this rank does in ``plan`` (global rank -> action;
``"*"`` for every other rank) and does it. Actions are tuples:

- ``("return", value)``: return ``value`` at once.
- ``("sleep", seconds)``: block in ``time.sleep``, then return the rank.
- ``("pid",)``: return this rank process's pid.
- ``("die", kind, delay)``: after ``delay`` s, write a last stderr line and die by ``kind``:
  ``"segv"`` (``ctypes.string_at(0)``), ``"exit3"`` (``os._exit(3)``), ``"sigkill"``
  (``os.kill(getpid, SIGKILL)``) or ``"oom"`` (allocate until the kernel's OOM killer strikes).
- ``("raise", type_name, delay)``: after ``delay`` s raise ``ValueError`` / :class:`FaultError`.
- ``("gloo",)``: join a gloo process group and all_reduce ``[rank]``; returns the sum.
- ``("gloo_raise", type_name)``: join the process group, then raise instead of joining the
  all_reduce the other ranks wait in.

Peers that notice a failure, the way the ranks of a collective do (gloo raises "Connection
reset by peer" the moment a peer's process goes), and ranks that take long to die (a rank
holding a lot of memory needs ~0.1 s per GiB to exit):

- ``("slow_to_die", mib, canary)``: hold ``mib`` MiB, start a *canary* child process in this
  rank's process group (so it dies the moment the pod server kills the group, while this
  rank is still tearing its memory down), write its pid to the file ``canary``, then sleep.
- ``("exit_slowly", mib, canary, code)``: the same, then kill the canary and
  ``os._exit(code)``: a rank whose own exit is under way while its peers already react.
- ``("raise_when_gone", type_name, canary)``: wait until the canary process has exited, then
  raise at once.

A fault waits until the file ``ready`` exists (when given), and writes ``time.time()`` to
``<stamps>/fault-<rank>`` right before it happens, so a test measures the time from the fault
to the error it gets (all processes share the clock).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ktlite.backends.processes import pid_alive  # noqa: F401  (the tests use it from here)

LAST_WORDS = "last words of rank {rank}: about to {what}"


class FaultError(Exception):
    """A custom exception type raised on a rank: the caller must catch it by this type."""


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write(path: Path, text: str) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def stamp(stamps: str | None, rank: int) -> None:
    """Record now as the moment of this rank's fault."""
    if stamps is not None:
        _write(Path(stamps) / f"fault-{rank}", repr(time.time()))


def read_stamp(stamps: str | Path, rank: int) -> float:
    return float((Path(stamps) / f"fault-{rank}").read_text())


def _wait_file(path: str | None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while path is not None and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g}s")
        time.sleep(0.002)


def _exc(type_name: str, message: str) -> BaseException:
    return {"ValueError": ValueError, "FaultError": FaultError}[type_name](message)


def die(kind: str, stamps: str | None) -> None:
    rank = _rank()
    print(LAST_WORDS.format(rank=rank, what=f"die by {kind}"), file=sys.stderr, flush=True)
    if kind == "oom":
        # the kernel must pick this rank, not its pod server, when the cgroup runs out
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        hoard = []
        while True:  # 16 MiB at a time, every page written: resident, not just reserved
            stamp(stamps, rank)
            hoard.append(b"\x01" * (16 << 20))
    stamp(stamps, rank)
    if kind == "segv":
        ctypes.string_at(0)
    elif kind == "exit3":
        os._exit(3)
    elif kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(f"unknown death {kind!r}")


def _hold_with_canary(mib: int, canary: str) -> tuple[bytes, subprocess.Popen[bytes]]:
    hoard = b"\x01" * (mib << 20)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"], stdin=subprocess.DEVNULL
    )  # stays in this rank's process group
    _write(Path(canary), str(child.pid))
    return hoard, child


def _wait_gone(canary: str) -> None:
    _wait_file(canary)
    try:
        fd = os.pidfd_open(int(Path(canary).read_text()))
    except ProcessLookupError:
        return  # gone and reaped already
    try:
        select.select([fd], [], [], 60)
    finally:
        os.close(fd)


def act(
    plan: dict[Any, tuple[Any, ...]], stamps: str | None = None, ready: str | None = None
) -> Any:
    rank = _rank()
    name, *args = plan.get(rank, plan.get("*", ("return", rank)))
    if name == "return":
        return args[0]
    if name == "sleep":
        time.sleep(float(args[0]))
        return rank
    if name == "pid":
        return os.getpid()
    if name == "die":
        _wait_file(ready)
        time.sleep(float(args[1]) if len(args) > 1 else 0.0)
        die(args[0], stamps)
    if name == "raise":
        _wait_file(ready)
        time.sleep(float(args[1]) if len(args) > 1 else 0.0)
        print(LAST_WORDS.format(rank=rank, what=f"raise {args[0]}"), file=sys.stderr, flush=True)
        stamp(stamps, rank)
        raise _exc(args[0], f"injected {args[0]} on rank {rank}")
    if name == "slow_to_die":
        hoard, _ = _hold_with_canary(int(args[0]), args[1])
        time.sleep(300)
        return len(hoard)
    if name == "exit_slowly":
        hoard, child = _hold_with_canary(int(args[0]), args[1])
        time.sleep(0.2)  # the peer watching the canary has opened it by now
        print(
            LAST_WORDS.format(rank=rank, what=f"exit with code {args[2]}"),
            file=sys.stderr,
            flush=True,
        )
        stamp(stamps, rank)
        child.kill()
        os._exit(int(args[2]))
    if name == "raise_when_gone":
        _wait_gone(args[1])
        stamp(stamps, rank)
        raise _exc(args[0], f"rank {rank} raised {args[0]}: a peer went away under it")
    if name.startswith("gloo"):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if name == "gloo_raise":
            stamp(stamps, rank)
            raise _exc(args[0], f"injected {args[0]} on rank {rank}, outside the all_reduce")
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()
    raise AssertionError(f"unknown action {name!r}")


# ---- test side ---------------------------------------------------------------------------------
