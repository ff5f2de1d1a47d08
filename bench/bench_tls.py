"""What per-deployment TLS costs: the same calls with and without it, side by side (ratios
TLS / plain), on the local backend (``Compute(tls=True)`` against ``tls=False``).

    python bench/bench_tls.py            # 5 rounds of 200 warm calls, 3 rounds of transfers
    python bench/bench_tls.py --quick    # 3 rounds of 60, 2 rounds of transfers
    python bench/bench_tls.py --json out.json

Rows: a warm no-op call (1 worker) p50/p99; a warm no-op call on 2 workers (pod 0 calls pod 1:
the peer hop is TLS too) p50/p99; a 100 MB argument (bytes, to a function returning None)
and a 100 MB result (bytes it built once), as MB/s, best of the rounds, over the socket
(``KTLITE_SHM=0``: on one machine they would otherwise go through /dev/shm files). The two deployments
run round by round (``_rounds.run_rounds``), so both see the same stretch of the machine's
load, which is printed with the table. MB = 10^6 bytes. A private KTLITE_HOME.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-tls-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported
sys.path.insert(0, str(HERE))

import _rounds  # noqa: E402

import ktlite as kt  # noqa: E402

MB = 10**8  # the transfers' size: 100 MB
_BLOB: bytes | None = None


def noop() -> None:
    return None


def take(data: bytes) -> None:
    return None


def give() -> bytes:
    global _BLOB
    if _BLOB is None:
        _BLOB = b"\x07" * MB
    return _BLOB


def _pct(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rounds, calls, t_rounds = (3, 60, 2) if args.quick else (5, 200, 3)
    load = _rounds.LoadLog()
    failures: list[str] = []
    samples: dict[str, dict[str, list[float]]] = {}

    def failed(name: str, e: BaseException) -> None:
        failures.append(f"{name}: {type(e).__name__}: {e}")

    def deploy(fn: Callable[..., Any], on: bool, workers: int = 1) -> Any:
        compute = kt.Compute(cpus=1, tls=on, stream_logs=False)
        if workers > 1:
            compute = compute.distribute("spmd", workers=workers)
        name = f"tls-{'on' if on else 'off'}-{fn.__name__}-{workers}"
        remote = kt.fn(fn, name=name).to(compute)
        remotes.append(remote)
        return remote.options(stream_logs=False)

    remotes: list[Any] = []
    try:
        for row, fn, workers in (("warm call", noop, 1), ("warm call, 2 workers", noop, 2)):
            systems = {}
            for on in (False, True):
                remote = deploy(fn, on, workers)
                key = "TLS" if on else "plain"
                samples.setdefault(row, {})[key] = []

                def one(r: int, remote: Any = remote, key: str = key, row: str = row) -> None:
                    warm = 30 if r == 0 else 5
                    samples[row][key] += _rounds.timed_calls(remote, calls, warm)

                systems[key] = one
            _rounds.run_rounds(row, systems, rounds, load, failed)
        # the transfers over the socket, as between machines: on one machine the local backend
        # would pass them through /dev/shm files, which no TLS touches
        os.environ["KTLITE_SHM"] = "0"
        for row, fn in (("100 MB argument", take), ("100 MB result", give)):
            systems = {}
            for on in (False, True):
                remote = deploy(fn, on)
                key = "TLS" if on else "plain"
                samples.setdefault(row, {})[key] = []
                blob = b"\x07" * MB

                def one(
                    r: int, remote: Any = remote, key: str = key, row: str = row, blob: bytes = blob
                ) -> None:
                    call = (lambda: remote(blob)) if row.endswith("argument") else remote
                    if r == 0:
                        call()  # warm-up: buffers, page faults
                    samples[row][key] += _rounds.timed_calls(call, 1, 0)

                systems[key] = one
            _rounds.run_rounds(row, systems, t_rounds, load, failed)
    finally:
        for remote in remotes:
            try:
                remote.teardown()
            except Exception as e:  # noqa: BLE001 - tear the others down all the same
                failures.append(f"teardown: {e!r}")
        shutil.rmtree(_HOME, ignore_errors=True)

    print(f"\nktlite TLS cost, local backend ({_rounds.loadavg() and load.summary()})")
    print(f"{'row':<24}{'plain':>22}{'TLS':>22}{'TLS / plain':>16}")
    for row, by in samples.items():
        plain, secure = by.get("plain") or [], by.get("TLS") or []
        if not plain or not secure:
            print(f"{row:<24}{'(failed)':>22}")
            continue
        if row.startswith("100 MB"):
            a, b = MB / 1e6 / min(plain), MB / 1e6 / min(secure)
            print(f"{row:<24}{a:>17.0f} MB/s{b:>17.0f} MB/s{b / a:>16.2f}")
            continue
        for p in (50, 99):
            a, b = _pct(plain, p), _pct(secure, p)
            label = f"{row} p{p}"
            print(f"{label:<24}{a * 1e3:>19.3f} ms{b * 1e3:>19.3f} ms{b / a:>16.2f}")
    for line in load.lines():
        print(f"  load: {line}")
    for f in failures:
        print(f"  FAILED {f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"samples": samples, "load": load.as_json(), "failures": failures})
        )


if __name__ == "__main__":
    main()
