"""A stateful remote class: the instance lives in the pod, so its state persists between calls.

Run from the repository root:

    python examples/stateful_class.py

Part 1 deploys one instance on one pod and calls its methods. Part 2 deploys the same class
on 2 workers x 2 processes: each rank holds its own instance, and every method call runs on
all ranks and returns a list indexed by rank.
"""

from __future__ import annotations

import os

import ktlite as kt


class Accumulator:
    """Keeps a running total; each call updates it in place."""

    def __init__(self, start: float = 0.0) -> None:
        self.total = start
        self.calls = 0
        self.rank = int(os.environ.get("RANK", "0"))

    def add(self, x: float) -> float:
        self.total += x
        self.calls += 1
        print(f"added {x}, total is now {self.total}")
        return self.total

    def info(self) -> dict:
        return {
            "rank": self.rank,
            "pod": os.environ["KTLITE_POD_NAME"],
            "pid": os.getpid(),
            "total": self.total,
            "calls": self.calls,
        }


def single() -> None:
    acc = kt.cls(Accumulator).to(kt.Compute(cpus=1), init_args={"start": 10})
    try:
        for x in (1, 2, 3):
            acc.add(x)
        info = acc.info()
        print(f"single instance: {info}")
        assert info["total"] == 16 and info["calls"] == 3, info
    finally:
        acc.teardown()


def distributed() -> None:
    compute = kt.Compute(cpus=2).distribute("spmd", workers=2, num_proc=2)
    acc = kt.cls(Accumulator, name="accumulator-ranks").to(compute, init_args={"start": 0})
    try:
        acc.add(1)
        totals = acc.add(10)  # a list: totals[r] came from RANK r
        print(f"per-rank totals: {totals}")
        assert totals == [11, 11, 11, 11], totals
        for row in acc.info():
            print(
                f"rank {row['rank']} on {row['pod']} (pid {row['pid']}): "
                f"total {row['total']} after {row['calls']} calls"
            )
    finally:
        acc.teardown()


if __name__ == "__main__":
    single()
    distributed()
