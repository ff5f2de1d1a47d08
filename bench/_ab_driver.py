"""One side of ``bench_ab.py``: ktlite's hot rows against the ktlite that this Python imports.

``bench_ab.py`` starts this file twice, once with the "before" tree's Python and once with the
"after" tree's, and asks each for one round at a time over ``_peer_link`` (like the Ray peer).
The same file must run against both trees while the modules inside ktlite move, so it uses
only the public API: ``import ktlite as kt``; ``kt.fn``, ``kt.Compute``, ``.distribute``,
``.options``, ``.submit``, ``kt.per_rank``, ``.teardown()``.

Requests (each a line ``{"op": ..., **kwargs}``; see ``Driver`` for the replies):

- ``deploy(key, name, workers, num_proc, concurrency)``: ``kt.fn(job, name=name).to(...)``,
  checked with one call; the seconds of ``.to()`` and where the rank imported ktlite from;
- ``measure(key, row, n, warmup, kind)``: one round of ``row`` on deployment ``key``, its
  samples (seconds per call, or calls/s, or MB/s: ``ROWS``);
- ``teardown(key)``.

Started as ``python bench/_ab_driver.py --reply-fd FD`` in a working directory outside any
source tree, with its own ``KTLITE_HOME`` (the harness does both).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any

from _peer_link import open_replies
from _rounds import clock, timed_calls

SUBMIT = 100  # calls per batch of the "submit" row
PERRANK_BYTES = 1_000_000  # each rank's item in the "perrank" row
XFER_BYTES = 100 * 1_000_000  # the "arg" and "result" rows
MB = 1_000_000

# row -> the unit of its samples
ROWS = {
    "call": "s",  # one no-op call, every rank (seconds)
    "perrank": "s",  # one call with kt.per_rank(1 MB per rank) (seconds)
    "submit": "calls/s",  # SUBMIT calls submitted at once (calls per second of the batch)
    "arg": "MB/s",  # a 100 MB value as the argument
    "result": "MB/s",  # a 100 MB value as the result
}

# ---- what runs on the ranks (in __main__: ktlite ships it by value) ---------------------------

_HELD: dict[str, Any] = {}  # on the rank: the 100 MB result, built once per deployment


def value(kind: str, nbytes: int) -> Any:
    """``nbytes`` as a float32 numpy array (kind "numpy") or as bytes (kind "bytes")."""
    if kind == "numpy":
        import numpy

        return numpy.ones(nbytes // 4, dtype=numpy.float32)
    return b"\x01" * nbytes


def job(x: Any = None, make: str | None = None, probe: bool = False) -> Any:
    """No argument: a no-op. ``x``: its length. ``make``: a held 100 MB value of that kind.
    ``probe``: where this rank imported ktlite's packages from."""
    if probe:
        import sys

        return {
            name: getattr(mod, "__file__", None)
            for name, mod in sorted(sys.modules.items())
            if name.split(".")[0].startswith("ktlite") and "." not in name
        }
    if make is not None:
        if make not in _HELD:
            _HELD[make] = value(make, XFER_BYTES)
        return _HELD[make]
    return None if x is None else len(x)


# ---- the driver ---------------------------------------------------------------------------------


class Driver:
    def __init__(self) -> None:
        import ktlite as kt

        self.kt = kt
        self.remotes: dict[str, Any] = {}
        self.worlds: dict[str, int] = {}

    def ready(self) -> dict[str, Any]:
        try:
            import numpy  # noqa: F401

            has_numpy = True
        except ImportError:
            has_numpy = False
        return {
            "ktlite": getattr(self.kt, "__version__", "?"),
            "ktlite_dir": os.path.dirname(os.path.abspath(self.kt.__file__)),
            "python": sys.version.split()[0],
            "executable": sys.executable,
            "numpy": has_numpy,
            "pid": os.getpid(),
        }

    def deploy(
        self, key: str, name: str, workers: int, num_proc: int, concurrency: int | None = None
    ) -> dict[str, Any]:
        kt = self.kt
        if key in self.remotes:
            raise ValueError(f"deployment {key!r} is up already: tear it down first")
        compute = kt.Compute(
            cpus=1,
            memory="1Gi",
            stream_logs=False,
            **({"concurrency": concurrency} if concurrency else {}),
        )
        world = workers * num_proc
        if world > 1:
            compute = compute.distribute("spmd", workers=workers, num_proc=num_proc)
        t = clock()
        remote = kt.fn(job, name=name).to(compute)
        to_s = clock() - t
        self.remotes[key], self.worlds[key] = remote, world
        call = remote.options(stream_logs=False)
        want = None if world == 1 else [None] * world
        got = call()
        if got != want:
            raise RuntimeError(f"{name}: the no-op returned {got!r}, expected {want!r}")
        probe = call(probe=True)
        return {"to_s": to_s, "world": world, "rank_modules": probe if world == 1 else probe[0]}

    def measure(self, key: str, row: str, n: int, warmup: int, kind: str = "bytes") -> list[float]:
        if row not in ROWS:
            raise ValueError(f"unknown row {row!r}; the rows are {', '.join(ROWS)}")
        if key not in self.remotes:
            raise ValueError(f"no deployment {key!r}: deploy it first (up: {sorted(self.remotes)})")
        call, world = self.remotes[key].options(stream_logs=False), self.worlds[key]
        if row == "call":
            return timed_calls(call, n, warmup)
        if row == "perrank":
            shards = [os.urandom(PERRANK_BYTES) for _ in range(world)]
            want = [PERRANK_BYTES] * world

            def each() -> None:
                got = call(self.kt.per_rank(shards))
                if got != want:
                    raise RuntimeError(f"kt.per_rank call returned {got!r}, expected {want!r}")

            return timed_calls(each, n, warmup)
        if row == "submit":
            return [self._batch(call, warmup > 0) for _ in range(n)]
        return [self._transfer(call, row, kind, warmup > 0) for _ in range(n)]

    def _batch(self, call: Any, warm: bool) -> float:
        def batch() -> None:
            for future in [call.submit() for _ in range(SUBMIT)]:
                future.result(timeout=300)

        if warm:
            batch()
        gc.collect()
        t = clock()
        batch()
        return SUBMIT / (clock() - t)

    def _transfer(self, call: Any, row: str, kind: str, warm: bool) -> float:
        data = value(kind, XFER_BYTES) if row == "arg" else None

        def one() -> None:
            if row == "arg":
                got = call(data)
                if got != len(data):
                    raise RuntimeError(f"job(<100 MB {kind}>) returned {got!r}")
            else:
                got = call(make=kind)
                if len(got) * (4 if kind == "numpy" else 1) != XFER_BYTES:
                    raise RuntimeError(f"job(make={kind!r}) returned {type(got).__name__}")

        if warm:
            one()
        gc.collect()
        t = clock()
        one()
        return XFER_BYTES / (clock() - t) / MB

    def teardown(self, key: str) -> None:
        remote = self.remotes.pop(key, None)
        self.worlds.pop(key, None)
        if remote is not None:
            remote.teardown()

    def close(self) -> None:
        for key in list(self.remotes):
            try:
                self.teardown(key)
            except Exception as e:  # noqa: BLE001 - tear down the others too
                print(
                    f"[ab driver] teardown of {key} failed: {type(e).__name__}: {e}",
                    file=sys.stderr,
                )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args()
    replies = open_replies(args.reply_fd)
    driver = Driver()
    try:
        replies.serve(
            driver.ready(),
            {"deploy": driver.deploy, "measure": driver.measure, "teardown": driver.teardown},
        )
    finally:
        driver.close()


if __name__ == "__main__":
    main()
