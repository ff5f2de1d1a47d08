"""Bulk data: 100 MB caller -> pod, pod -> caller and pod -> pod over HTTP, beside the floors
(issue 26, item 5), with the peak memory of the client and the pod server.

    python bench/bench_data.py            # 3 rounds
    python bench/bench_data.py --quick    # 2 rounds
    python bench/bench_data.py --json out.json

ktlite rows run on the local backend with ``KTLITE_SHM=0``, so the bytes take the HTTP path the
Kubernetes and SSH backends take (on one machine they would otherwise pass through /dev/shm
files): a float32 numpy array of 10^8 bytes as the argument of a function returning None, and
as the result of a function returning an array it built once and holds. Plain and TLS
(``Compute(tls=True)``: the default on SSH and Kubernetes). Pod -> pod: the same argument on a
2-pod deployment (pod 0 forwards the body to pod 1 once it has it), the rate of the added time
over the 1-pod call (infinite when the 2-pod call took no longer).

Floors, in the same rounds: loopback TCP (``sendall`` to ``recv_into``, in one process: into a
reused 1 MiB buffer, and into a fresh buffer of the payload's size, as a receiver that keeps
the bytes must), and a raw uvicorn server (``_raw_bulk.py``, uvloop + httptools) reading an
upload into a buffer allocated for it, and answering a download from a held buffer into a
fresh client buffer.

Memory: before each ktlite transfer the peak RSS of the client (this process) and of the pod
server (its pid from ``remote.status()``) is reset (``/proc/<pid>/clear_refs``), and after it
the rise of the peak over the RSS before is reported, as MB and as a multiple of the payload:
what the transfer held at once beyond what was there. MB = 10^6 bytes.

CPU: the CPU time (user + system) a transfer took in the client (this process) and in the pod
(its server and rank processes, from ``/proc/<pid>/stat``, in clock ticks of 10 ms): on a
machine shared with other jobs the wall-clock rates move by 2x from run to run, the work a
transfer costs much less.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-data-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported
os.environ["KTLITE_SHM"] = "0"  # the HTTP path, as between machines
sys.path.insert(0, str(HERE))

import _rounds  # noqa: E402
import numpy  # noqa: E402
from _bench_peers import _stop  # noqa: E402

import ktlite as kt  # noqa: E402

N = 10**8
MB = 1e6
TARGET_MBPS = 2000.0
clock = time.perf_counter
_HELD: dict[str, Any] = {}


def xfer(x: Any = None, give: bool = False) -> Any:
    """With ``give``: a held 10^8-byte array; else take ``x`` and return None."""
    if not give:
        return None
    if "a" not in _HELD:
        import numpy

        _HELD["a"] = numpy.ones(N // 4, dtype=numpy.float32)
    return _HELD["a"]


# ---- memory: the peak RSS of a process, reset before a transfer ---------------------------


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _family(pid: int) -> list[int]:
    """``pid`` and its children (a pod server's rank processes)."""
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            continue
    return [pid, *kids]


def pod_cpu_s(pid: int) -> float:
    total = 0.0
    for p in _family(pid):
        try:
            total += _cpu_s(p)
        except OSError:  # a rank process that exited meanwhile
            continue
    return total


class Peak:
    """The rise of ``pid``'s peak RSS over its RSS when armed (bytes)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = 0

    def arm(self) -> None:
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.base = _status_kb(self.pid, "VmRSS")

    def rise(self) -> int:
        return max(0, _status_kb(self.pid, "VmHWM") - self.base) * 1024


# ---- floors -----------------------------------------------------------------------------------


def loopback(fresh: bool) -> float:
    """MB/s of N bytes over a 127.0.0.1 socket pair: into a reused 1 MiB buffer, or a fresh one."""
    payload = memoryview(bytearray(N))
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
        with a, b:
            done: list[int] = []

            def drain() -> None:
                if fresh:
                    view, got = memoryview(bytearray(N)), 0
                    while got < N and (k := b.recv_into(view[got:])):
                        got += k
                else:
                    sink, got = memoryview(bytearray(1 << 20)), 0
                    while got < N and (k := b.recv_into(sink)):
                        got += k
                done.append(got)

            reader = threading.Thread(target=drain)
            t = clock()
            reader.start()
            a.sendall(payload)
            reader.join(120)
            if not done or done[0] != N:
                raise RuntimeError(f"loopback TCP: the reader got {done} of {N} bytes in 120 s")
            return N / (clock() - t) / MB


class RawBulk:
    """``_raw_bulk.py`` in its own session: ``up()`` and ``down()`` move N bytes (MB/s)."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_raw_bulk.py"), "--parent-pid", str(os.getpid())],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline and self.proc.poll() is None and not line:
            line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            _stop(self.proc)
            raise RuntimeError(
                f"the raw uvicorn server did not start within {timeout:g}s: {line!r}"
            )
        _, port, loop, http, pid = line.split()
        self.port, self.how, self.pid = int(port), f"uvicorn {loop}+{http}", int(pid)
        self.payload = memoryview(bytearray(b"\x07" * N))

    def _request(self, head: bytes, body: memoryview | None, into: memoryview) -> int:
        with socket.create_connection(("127.0.0.1", self.port), timeout=120) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(head)
            if body is not None:
                s.sendall(body)
            got = 0
            while (k := s.recv_into(into[got:])) > 0:
                got += k
                end = bytes(into[: min(got, 512)]).find(b"\r\n\r\n")
                if end >= 0:
                    length = int(bytes(into[:end]).lower().split(b"content-length:")[1].split()[0])
                    if got >= end + 4 + length:
                        return got - end - 4
            raise RuntimeError("the raw uvicorn server closed the connection early")

    def up(self) -> float:
        t = clock()
        head = (
            f"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: {N}\r\nconnection: close\r\n\r\n"
        )
        self._request(head.encode(), self.payload, memoryview(bytearray(4096)))
        return N / (clock() - t) / MB

    def down(self) -> float:
        t = clock()
        into = memoryview(bytearray(N + 4096))
        head = f"GET /download?n={N} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        if self._request(head.encode(), None, into) != N:
            raise RuntimeError("the raw uvicorn server answered a short body")
        return N / (clock() - t) / MB

    def close(self) -> None:
        _stop(self.proc)


# ---- ktlite -------------------------------------------------------------------------------


class Kt:
    """One deployment of ``xfer``: its transfers' MB/s and the peak RSS they raised."""

    def __init__(self, name: str, tls: bool, workers: int) -> None:
        compute = kt.Compute(cpus=1, tls=tls, stream_logs=False)
        if workers > 1:
            compute = compute.distribute("spmd", workers=workers)
        self.remote = kt.fn(xfer, name=name).to(compute)
        self.call = self.remote.options(stream_logs=False)
        self.server = Peak(int(self.remote.status()[0]["server_pid"]))
        self.client = Peak(os.getpid())
        self.value = numpy.ones(N // 4, dtype=numpy.float32)
        # each direction's first transfer (imports, the held array, the connection, and the
        # client's first receive memory), measured apart: the rounds measure warm transfers
        self.first: dict[str, tuple[float, int, int, float, float]] = {}

    def _timed(self, fn: Callable[[], None], key: str) -> tuple[float, int, int, float, float]:
        if key not in self.first:
            self.first[key] = self._measure(fn)
        return self._measure(fn)

    def _measure(self, fn: Callable[[], None]) -> tuple[float, int, int, float, float]:
        gc.collect()
        self.client.arm()
        self.server.arm()
        pod0, client0 = pod_cpu_s(self.server.pid), time.process_time()
        t = clock()
        fn()
        dt = clock() - t
        client_cpu, pod_cpu = time.process_time() - client0, pod_cpu_s(self.server.pid) - pod0
        return N / dt / MB, self.client.rise(), self.server.rise(), client_cpu, pod_cpu

    def arg(self) -> tuple[float, int, int, float, float]:
        def one() -> None:
            if self.call(self.value) not in (None, [None, None]):
                raise RuntimeError("xfer(x) returned something")

        return self._timed(one, "arg")

    def result(self) -> tuple[float, int, int, float, float]:
        def one() -> None:
            got = self.call(give=True)
            if isinstance(got, list):  # a 2-pod deployment answers per rank
                got = got[0]
            if got.nbytes != N or float(got[-1]) != 1.0:
                raise RuntimeError(f"xfer(give=True) returned {type(got)} of {got.nbytes} bytes")

        return self._timed(one, "result")

    def close(self) -> None:
        self.remote.teardown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rounds = 2 if args.quick else 3
    load = _rounds.LoadLog()
    failures: list[str] = []
    rates: dict[str, list[float]] = {}
    mem: dict[str, list[tuple[int, int]]] = {}
    cpu: dict[str, list[tuple[float, float]]] = {}
    started = clock()

    def failed(name: str, e: BaseException) -> None:
        failures.append(f"{name}: {type(e).__name__}: {e}")

    def record(row: str, got: float | tuple[float, int, int, float, float]) -> None:
        if isinstance(got, tuple):
            rates.setdefault(row, []).append(got[0])
            mem.setdefault(row, []).append((got[1], got[2]))
            cpu.setdefault(row, []).append((got[3], got[4]))
        else:
            rates.setdefault(row, []).append(got)

    deployments: list[Kt] = []
    raw = None
    try:
        raw = RawBulk()
        plain = Kt("data-plain", tls=False, workers=1)
        deployments.append(plain)
        secure = Kt("data-tls", tls=True, workers=1)
        deployments.append(secure)
        two = Kt("data-2pods", tls=False, workers=2)
        deployments.append(two)
        raw_bulk = raw

        def floors_tcp(r: int) -> None:
            record("loopback TCP, reused 1 MiB buffer", loopback(False))
            record("loopback TCP, fresh 100 MB buffer", loopback(True))

        def floors_raw(r: int) -> None:
            record(f"raw {raw_bulk.how}: upload", raw_bulk.up())
            record(f"raw {raw_bulk.how}: download", raw_bulk.down())

        def kt_plain(r: int) -> None:
            record("ktlite argument (caller -> pod)", plain.arg())
            record("ktlite result (pod -> caller)", plain.result())
            if r == 0:  # the process's first result: into memory it never touched
                record("ktlite result, the process's first", plain.first["result"])

        def kt_tls(r: int) -> None:
            record("ktlite TLS argument (caller -> pod)", secure.arg())
            record("ktlite TLS result (pod -> caller)", secure.result())

        def kt_two(r: int) -> None:
            record("ktlite argument, 2 pods", two.arg())

        systems: dict[str, Callable[[int], None]] = {
            "loopback TCP": floors_tcp,
            "raw uvicorn": floors_raw,
            "ktlite plain": kt_plain,
            "ktlite TLS": kt_tls,
            "ktlite 2 pods": kt_two,
        }
        _rounds.run_rounds("100 MB transfers", systems, rounds, load, failed)
    finally:
        for d in deployments:
            try:
                d.close()
            except Exception as e:  # noqa: BLE001 - tear the others down all the same
                failures.append(f"teardown: {e!r}")
        if raw is not None:
            raw.close()
        shutil.rmtree(_HOME, ignore_errors=True)
    report(rates, mem, cpu, load, failures, clock() - started, rounds)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rates": rates,
                    "memory": mem,
                    "cpu": cpu,
                    "load": load.as_json(),
                    "failures": failures,
                }
            )
        )


def report(
    rates: dict[str, list[float]],
    mem: dict[str, list[tuple[int, int]]],
    cpu: dict[str, list[tuple[float, float]]],
    load: _rounds.LoadLog,
    failures: list[str],
    wall: float,
    rounds: int,
) -> None:
    print(
        f"\nktlite bulk data over HTTP: 10^8 bytes, {rounds} rounds, {wall:.0f} s; Python "
        f"{sys.version.split()[0]}, {os.cpu_count()} CPU(s)\n{load.summary()}\n"
        "MB/s: median (best); peak RSS rise: median over the rounds, MB and x payload; "
        "CPU: median ms of one transfer (user + system)"
    )
    floor = statistics.median(rates.get("loopback TCP, fresh 100 MB buffer") or [0]) or None
    print(
        f"\n{'measurement':<44}{'MB/s':>16}{'vs fresh TCP':>14}{'client peak':>18}"
        f"{'server peak':>18}{'CPU client':>12}{'CPU pod':>10}"
    )
    for row, got in rates.items():
        med = statistics.median(got)
        cells = f"{med:>9,.0f} ({max(got):,.0f})"
        ratio = f"{med / floor:.2f}" if floor else "-"
        peaks = ["", ""]
        if row in mem:
            for i in (0, 1):
                rise = statistics.median(m[i] for m in mem[row])
                peaks[i] = f"{rise / MB:,.0f} MB ({rise / N:.2f}x)"
        used = ["", ""]
        if row in cpu:
            for i in (0, 1):
                used[i] = f"{statistics.median(c[i] for c in cpu[row]) * 1e3:,.0f}"
        print(
            f"{row:<44}{cells:>16}{ratio:>14}{peaks[0]:>18}{peaks[1]:>18}{used[0]:>12}{used[1]:>10}"
        )
    one = statistics.median(rates.get("ktlite argument (caller -> pod)") or [0])
    two = statistics.median(rates.get("ktlite argument, 2 pods") or [0])
    if one and two and N / two > N / one:
        hop = N / (N / (two * MB) - N / (one * MB)) / MB
        print(f"{'ktlite pod -> pod (2 pods less 1 pod)':<44}{hop:>9,.0f}{'':>7}")
        rates["ktlite pod -> pod (derived)"] = [hop]
    elif one and two:  # the 2-pod call was no slower (noise): the hop's time is not measurable
        print(f"{'ktlite pod -> pod (2 pods less 1 pod)':<44}{'inf':>9}  (2 pods no slower)")
        rates["ktlite pod -> pod (derived)"] = [float("inf")]
    print(f"\n{'target':<52}{'measured':>14}  met")
    for row in (
        "ktlite argument (caller -> pod)",
        "ktlite result (pod -> caller)",
        "ktlite pod -> pod (derived)",
    ):
        if rates.get(row):
            med = statistics.median(rates[row])
            ok = "yes" if med >= TARGET_MBPS else "no"
            print(f"{row + ' >= 2 GB/s':<52}{med:>9,.0f} MB/s  {ok}")
    for line in load.lines():
        print(f"  load: {line}")
    for f in failures:
        print(f"  FAILED {f}")


if __name__ == "__main__":
    main()
