"""One side of ``bench_cpu.py``: a deployment, warm calls, then N calls counted by callgrind.

    python bench/_cpu_driver.py ROW NAME CALLS      (run under valgrind --tool=callgrind)

Uses only the public API, so the same file drives any ktlite tree. The counters of every
process (this caller, the pod servers, the rank processes) are zeroed after the warm-up
(``callgrind_control -z``), dumped as "warm" after the measured calls, zeroed again, and dumped
as "idle" after ``IDLE_S`` seconds without calls: what each process spends doing nothing in
that time is subtracted from its count by the harness. Prints ``WALL <s>`` and ``IDLE <s>``.
"""

from __future__ import annotations

import subprocess
import sys
import time

import ktlite as kt

IDLE_S = 8.0
SUBMIT = 100  # calls per batch of the submit row (as bench_ab.py's)


def job() -> int:
    return 1


def _compute(row: str) -> kt.Compute:
    if row == "submit":
        return kt.Compute(
            cpus=1, memory="1Gi", stream_logs=False, launch_timeout=900, concurrency=8
        )
    compute = kt.Compute(cpus=1, memory="1Gi", stream_logs=False, launch_timeout=900)
    if row.startswith("fanout"):
        compute = compute.distribute("spmd", workers=int(row.removeprefix("fanout")))
    if row.startswith("ranks"):  # one pod of N ranks
        compute = compute.distribute("spmd", num_proc=int(row.removeprefix("ranks")))
    return compute


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], capture_output=True, timeout=120, check=False)


def main() -> None:
    row, name, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
    remote = kt.fn(job, name=name).to(_compute(row))
    try:
        call = remote.options(stream_logs=False)

        def once() -> None:
            if row == "submit":
                for future in [call.submit() for _ in range(SUBMIT)]:
                    future.result()
            else:
                call()

        for _ in range(3 if row == "submit" else 30):
            once()
        _control("-z")
        start = time.perf_counter()
        for _ in range(calls):
            once()
        wall = time.perf_counter() - start
        _control("-d", "warm")
        _control("-z")
        start = time.perf_counter()
        time.sleep(IDLE_S)
        idle = time.perf_counter() - start
        _control("-d", "idle")
        print(f"WALL {wall}", flush=True)
        print(f"IDLE {idle}", flush=True)
    finally:
        remote.teardown()


if __name__ == "__main__":
    main()
