"""How the benches compare systems on a machine whose load moves: rounds, and the load itself.

A bench that measures one system for a minute and its peer the next minute compares two
different machines when anything else runs (on a busy 2-core machine that moved the ratios
of ``bench_groups.py`` 2-10x). ``run_rounds`` runs every system once per round, the order
rotated by one each round, so each system's samples come from the same stretch of time as
its peers' and none is always first (after a warm-up) or last. ``LoadLog`` records
``os.getloadavg()`` before and after each step, so a table says what the machine was doing.

Standard library only: the peers' own processes (another venv) import it too.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

clock = time.perf_counter


def loadavg() -> tuple[float, float, float] | None:
    """``os.getloadavg()``, or None where the platform has none."""
    try:
        return os.getloadavg()
    except OSError:
        return None


class LoadLog:
    """The load average before and after each named step of a bench run."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        before, t0 = loadavg(), time.monotonic()
        try:
            yield
        finally:
            self.steps.append(
                {
                    "step": name,
                    "before": before,
                    "after": loadavg(),
                    "seconds": round(time.monotonic() - t0, 3),
                }
            )

    def summary(self) -> str:
        """One line: the 1-minute load average over the run, against the cores there are."""
        ones = [v[0] for s in self.steps for v in (s["before"], s["after"]) if v is not None]
        if not ones:
            return "load average: not recorded (no os.getloadavg() here, or no step ran)"
        return (
            f"load average (1 min) {ones[0]:.2f} at the start, {ones[-1]:.2f} at the end, "
            f"{min(ones):.2f}-{max(ones):.2f} over {len(self.steps)} step(s), on {os.cpu_count()} CPU(s)"
        )

    def lines(self) -> list[str]:
        """One line per step: its name and the 1-minute load before -> after."""

        def one(v: tuple[float, float, float] | None) -> str:
            return "?" if v is None else f"{v[0]:.2f}"

        return [
            f"{s['step']}: {one(s['before'])} -> {one(s['after'])} ({s['seconds']:.1f} s)"
            for s in self.steps
        ]

    def as_json(self) -> list[dict[str, Any]]:
        return list(self.steps)


def run_rounds(
    what: str,
    systems: dict[str, Callable[[int], None]],
    rounds: int,
    load: LoadLog,
    failed: Callable[[str, BaseException], None],
) -> set[str]:
    """Call each of ``systems`` once per round with the round's index, ``rounds`` times.

    Round r starts with the system r places down the list (round 0: the given order), so each
    runs first, in the middle and last alike. A system that raises is reported to ``failed``
    and left out of the later rounds; the others go on. Returns the names that failed.
    """
    names = list(systems)
    dropped: set[str] = set()
    for r in range(rounds):
        shift = r % len(names) if names else 0
        order = [n for n in names[shift:] + names[:shift] if n not in dropped]
        if not order:
            break
        print(
            f"[bench] {what}: round {r + 1}/{rounds}: {', '.join(order)}",
            file=sys.stderr,
            flush=True,
        )
        with load.step(f"{what}, round {r + 1}/{rounds} ({', '.join(order)})"):
            for name in order:
                try:
                    systems[name](r)
                except Exception as e:  # noqa: BLE001 - one broken system must not stop its peers' rounds
                    dropped.add(name)
                    failed(name, e)
    return dropped


def timed_calls(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn``, one after another, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    gc.collect()
    out = []
    for _ in range(iters):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def fmt_s(s: float | None) -> str:
    """Seconds as the overhead tables print them: ms below a second, else s; None is '-'."""
    if s is None:
        return "-"
    return f"{s * 1000:.1f} ms" if abs(s) < 1 else f"{s:.2f} s"


def print_overheads(
    rows: list[tuple[str, float | None, float | None, str]],
    runs: str,
    load: LoadLog,
    notes: list[str],
    json_path: str | None,
) -> None:
    """The table of ``(measurement, ktlite s, peer s, what the peer is)`` rows with ktlite's
    overhead, the raw runs, the load of every step and the notes; the same as JSON."""
    print(load.summary())
    print(f"{'measurement':<46} {'ktlite':>9} {'peer':>9} {'overhead':>9}  peer is")
    print(f"{'-' * 46} {'-' * 9} {'-' * 9} {'-' * 9}  {'-' * 27}")
    for name, ours, theirs, peer in rows:
        overhead = None if ours is None or theirs is None else ours - theirs
        print(f"{name:<46} {fmt_s(ours):>9} {fmt_s(theirs):>9} {fmt_s(overhead):>9}  {peer}")
    print(f"runs: {runs}")
    print("load average (1 min) before -> after each run:")
    print("\n".join(f"  {line}" for line in load.lines()))
    for note in notes:
        print(f"- {note}")
    if json_path:
        import json

        rows_json = [{"name": n, "ktlite_s": a, "peer_s": b, "peer": p} for n, a, b, p in rows]
        with open(json_path, "w") as f:
            json.dump({"rows": rows_json, "load": load.as_json(), "notes": notes}, f, indent=2)
