"""Monarch-mesh benchmark (issue 11): ktlite's distribute("monarch") beside Monarch by hand.

    python bench/bench_monarch.py [--runs 3] [--json out.json]

Rows, each the median of ``--runs`` (cold rows) or of 30 calls (warm rows):

- cold, to the first result: 2 hosts x 2 procs, from nothing to an endpoint's answers from
  all four procs. ktlite: ``kt.cls(Controller).to(Compute().distribute("monarch", workers=2,
  num_proc=2))`` then one call (two pod servers start, each runs Monarch's worker loop, pod
  0 waits until both answer, the controller process starts and attaches, spawns the procs
  and their actors, the call runs). By hand: the same two ``run_worker_loop_forever``
  processes (unix sockets, as ktlite's local pods use), then a controller process that
  attaches, spawns the same procs and actors and calls the endpoint.
- warm call: one endpoint call on the four actors (``actors.ping.call().get()``), through a
  ktlite method call on the controller class, against the hand-run controller calling it
  in a loop.

``overhead`` is ktlite's time minus the peer's. Each run starts ktlite's mesh and the
hand-started one in turn, the order rotated between runs (``_rounds.py``); the load average is
recorded before and after each run and printed with the table.
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

if __name__ == "__main__":  # not in the hand-run controller, which imports this module
    _HOME = tempfile.mkdtemp(prefix="ktlite-bench-monarch-")
    os.environ["KTLITE_HOME"] = (
        _HOME  # before ktlite is imported: never share the tests' deployments
    )
    os.environ.pop("KTLITE_BACKEND", None)

from _rounds import LoadLog, print_overheads, run_rounds  # noqa: E402

import ktlite as kt  # noqa: E402

clock = time.perf_counter
WARM_CALLS = 30


class Controller:
    """The same controller both ways: 2 x 2 procs, one actor each."""

    def __init__(self, workers: list[str] | None = None) -> None:
        from monarch.actor import Actor, endpoint

        class Pinger(Actor):
            @endpoint
            def ping(self) -> int:
                return 1

        if workers is None:  # on a ktlite pod 0
            from ktlite.distributed import monarch_hosts

            hosts = monarch_hosts()
        else:
            from monarch.actor import attach_to_workers

            hosts = attach_to_workers(ca="trust_all_connections", workers=workers)
        self.procs = hosts.spawn_procs(per_host={"gpus": 2})
        self.actors = self.procs.spawn("pinger", Pinger)

    def ping(self) -> int:
        return sum(v for _, v in self.actors.ping.call().get().items())


# ---- ktlite ----------------------------------------------------------------------------------


def ktlite_cold(i: int) -> tuple[float, Any]:
    t0 = clock()
    remote = kt.cls(Controller, name=f"bench-monarch-{i}").to(
        kt.Compute(stream_logs=False).distribute("monarch", workers=2, num_proc=2)
    )
    assert remote.ping() == 4
    return clock() - t0, remote


def ktlite_warm(remote: Any) -> list[float]:
    times = []
    for _ in range(WARM_CALLS):
        t0 = clock()
        remote.ping()
        times.append(clock() - t0)
    return times


# ---- Monarch by hand -------------------------------------------------------------------------

WORKER = (
    "import sys; from monarch.actor import run_worker_loop_forever; "
    "run_worker_loop_forever(address=sys.argv[1], ca='trust_all_connections')"
)

DRIVER = """
import sys, time, json
sys.path.insert(0, {here!r})
from bench_monarch import Controller
n = int(sys.argv[1])
c = Controller({workers!r})
assert c.ping() == 4
times = []
for _ in range(n):
    t0 = time.perf_counter(); c.ping(); times.append(time.perf_counter() - t0)
c.procs.stop().get()
print("TIMES " + json.dumps(times))
"""


def _until_listening(path: str, deadline: float) -> None:
    while clock() < deadline:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            return
        time.sleep(0.01)
    raise TimeoutError(path)


def by_hand(warm_calls: int) -> tuple[float, list[float]]:
    """Two worker loops and a controller: (seconds to the first result, warm call times)."""
    sockets = tempfile.mkdtemp(prefix="ktmon-b")
    workers = [f"ipc://{sockets}/{k}" for k in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        t0 = clock()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, w],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            for w in workers
        ]
        for w in workers:
            _until_listening(w[len("ipc://") :], clock() + 60)
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER.format(here=here, workers=workers), str(warm_calls)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        cold = clock() - t0
        line = next((x for x in driver.stdout.splitlines() if x.startswith("TIMES ")), None)
        if driver.returncode != 0 or line is None:
            raise RuntimeError(driver.stdout[-1000:] + driver.stderr[-2000:])
        # the driver's cold time includes its warm loop: take it out
        warm = json.loads(line[len("TIMES ") :])
        return cold - sum(warm), warm
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the loop's session: it and its procs
        for p in procs:
            p.wait(10)
        shutil.rmtree(sockets, ignore_errors=True)


def _median(samples: list[float]) -> float | None:
    return statistics.median(samples) if samples else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    kt_cold: list[float] = []
    hand_cold: list[float] = []
    kt_warm: list[float] = []
    hand_warm: list[float] = []
    load, notes = LoadLog(), []

    def ktlite(r: int) -> None:
        t, remote = ktlite_cold(r)
        try:
            kt_cold.append(t)
            if r == 0:
                kt_warm.extend(ktlite_warm(remote))
        finally:
            remote.teardown()

    def hand(r: int) -> None:
        t, warm = by_hand(WARM_CALLS if r == 0 else 0)
        hand_cold.append(t)
        hand_warm.extend(warm)

    def failed(name: str, e: BaseException) -> None:
        notes.append(f"{name} failed: {type(e).__name__}: {e}")

    try:  # each run: ktlite's mesh and the hand-started one, in turn (order rotated)
        run_rounds("cold mesh", {"ktlite": ktlite, "by hand": hand}, args.runs, load, failed)
    finally:
        shutil.rmtree(_HOME, ignore_errors=True)
    rows = [
        (
            "cold 2x2 mesh to the first endpoint result",
            _median(kt_cold),
            _median(hand_cold),
            "2 worker loops + controller",
        ),
        (
            f"warm endpoint call on 4 actors (p50 of {WARM_CALLS})",
            _median(kt_warm),
            _median(hand_warm),
            "controller in a loop",
        ),
    ]
    print_overheads(
        rows,
        f"ktlite cold {[round(t, 2) for t in kt_cold]}, by hand {[round(t, 2) for t in hand_cold]}",
        load,
        notes,
        args.json,
    )


if __name__ == "__main__":
    main()
