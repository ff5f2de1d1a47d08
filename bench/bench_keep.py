"""The warm shared memory a pod keeps between calls: bytes in ``/dev/shm`` after a run of
100 MB calls on one pod of 4 ranks (local backend), and after it stays idle.

    python bench/bench_keep.py                # 5 calls, then the bytes held
    python bench/bench_keep.py --idle 100     # ... and again after 100 s without calls

Each call sends a 100 MB float32 array to the 4 ranks and each rank returns a 100 MB array,
over HTTP (``KTLITE_SHM=0``: the pod server receives the argument into a file and sends the
results from the ranks' files, as on Kubernetes). What the pod holds is what it keeps for the
next call: its ranks' kept result files (``ktlite-{res,took,sent,idle}-w<rank pid>-*``) and
the argument files its server keeps free (``ktlite-free-arg-*``, found through its open file
descriptors), each summed by size. No peer: this is about the memory ktlite holds idle, which
on Kubernetes counts against the pod's memory limit (``/dev/shm`` is a memory-backed
``emptyDir``). MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

os.environ["KTLITE_HOME"] = tempfile.mkdtemp(prefix="ktlite-bench-keep-")  # before ktlite
os.environ["KTLITE_SHM"] = "0"

import numpy as np  # noqa: E402

import ktlite as kt  # noqa: E402
from ktlite_server import resultfiles  # noqa: E402
from ktlite_wire import argfiles, shm  # noqa: E402

SIZE = 10**8


class Echo:
    def echo(self, x: np.ndarray) -> tuple[int, int, np.ndarray]:
        return os.getpid(), os.getppid(), x + 1


def held(ranks: set[int], server: int) -> tuple[int, int]:
    """(bytes of the ranks' kept result files, bytes of the server's free argument files)."""
    marks = tuple(
        p + resultfiles.kept_prefix(pid).removeprefix(shm.RESULT_PREFIX)
        for pid in ranks
        for p in shm.KEPT_PREFIXES
    )
    results = 0
    for name in os.listdir(shm.shm_dir()):
        if name.startswith(marks):
            with contextlib.suppress(FileNotFoundError):
                results += os.path.getsize(os.path.join(shm.shm_dir(), name))
    args = 0
    for fd in os.listdir(f"/proc/{server}/fd"):
        try:
            target = os.readlink(f"/proc/{server}/fd/{fd}")
        except OSError:
            continue
        if os.path.basename(target).startswith(argfiles.FREE_PREFIX):
            args += os.path.getsize(target)
    return results, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--idle", type=float, default=0.0, help="seconds idle, then again")
    args = parser.parse_args()
    compute = kt.Compute(stream_logs=False).distribute("spmd", workers=1, num_proc=4)
    remote = kt.cls(Echo).to(compute, name="bench-keep")
    try:
        x = np.zeros(SIZE // 4, dtype=np.float32)
        ranks: set[int] = set()
        server = 0
        peak = 0
        for v in range(args.calls):
            x[:] = v
            got = remote.echo(x)
            ranks |= {pid for pid, _, _ in got}
            server = got[0][1]
            del got
            peak = max(peak, sum(held(ranks, server)))
        results, arg_files = held(ranks, server)
        print(
            f"load {os.getloadavg()[0]:.2f}; 1 pod x 4 ranks, {args.calls} calls of 100 MB each way"
        )
        print(
            f"{'kept after the calls: results / arguments / total (MB)':58s} "
            f"{results / 1e6:7.0f} {arg_files / 1e6:7.0f} {(results + arg_files) / 1e6:7.0f}"
        )
        print(f"{'most kept after any call (MB)':58s} {peak / 1e6:23.0f}")
        if args.idle:
            time.sleep(args.idle)  # the bench's wait: idle files go on their own
            results, arg_files = held(ranks, server)
            print(
                f"{f'kept after {args.idle:g} s idle (MB)':58s} "
                f"{results / 1e6:7.0f} {arg_files / 1e6:7.0f} {(results + arg_files) / 1e6:7.0f}"
            )
    finally:
        remote.teardown()


if __name__ == "__main__":
    sys.exit(main())
