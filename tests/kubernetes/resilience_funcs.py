"""Functions the real-cluster resilience tests run on pods (a local module: shipped by value).

Each call is recorded in a file of the pod's own ``/tmp`` so a test can prove that no call
ran twice, whatever happened to the connection that carried it.
"""

from __future__ import annotations

import os
import time

LEDGER = "/tmp/ktlite-test-ledger-{tag}-{rank}"


def record(tag: str, i: int, payload: bytes | None = None) -> int:
    """Append call number ``i`` to this rank's ledger; returns ``i``."""
    rank = os.environ["RANK"]
    with open(LEDGER.format(tag=tag, rank=rank), "a") as f:
        f.write(f"{i}\n")
    return i


def ledger(tag: str) -> list[int]:
    """The call numbers this rank ran, in order (empty when this pod is a new one)."""
    try:
        with open(LEDGER.format(tag=tag, rank=os.environ["RANK"])) as f:
            return [int(line) for line in f]
    except FileNotFoundError:
        return []


def nap(seconds: float) -> int:
    """Sleep, then return the rank."""
    time.sleep(seconds)
    return int(os.environ["RANK"])
