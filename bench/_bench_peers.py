"""The peers of ``bench.py``'s rows, each measured in the same rounds as ktlite's side:

- ``RawServer``: the floor of a warm call, a uvicorn + FastAPI + cloudpickle round trip
  (``_raw_server.py``) driven with ``httpx``;
- ``start_ray``: Ray's actor call and fan-out, in a peer process (``_ray_peer.py``);
- ``loopback_tcp_mbps``: 100 MB over a 127.0.0.1 socket pair, the transfers' upper bound;
- ``run_timed``: a command's wall time (torchrun launching the gloo job).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import httpx
from _peer_link import PeerProcess

HERE = Path(__file__).resolve().parent
MB = 1_000_000
clock = time.perf_counter


def _stop(proc: subprocess.Popen[Any]) -> None:
    """End ``proc``'s whole session: SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


class RawServer:
    """``_raw_server.py`` in its own session; ``call()`` is one no-op round trip."""

    def __init__(self, start_timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_raw_server.py"), "--parent-pid", str(os.getpid())],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            line = self._first_line(start_timeout)
            if not line.startswith("PORT "):
                err = (
                    self.proc.stderr.read()
                    if self.proc.poll() is not None and self.proc.stderr
                    else ""
                )
                raise RuntimeError(
                    f"the raw FastAPI server did not print its port within {start_timeout:g} s: "
                    f"got {line!r}; its stderr ended with {err[-500:]!r}"
                )
            _, port, loop, http = line.split()
            self.how = f"uvicorn loop={loop} http={http}"
            self.url = f"http://127.0.0.1:{port}/call"
            self.client = httpx.Client(timeout=30.0)
        except BaseException:
            _stop(self.proc)
            raise

    def _first_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                return self.proc.stdout.readline()
        return ""

    def call(self) -> None:
        body = cloudpickle.dumps(((), {}))
        resp = self.client.post(
            self.url, content=body, headers={"content-type": "application/octet-stream"}
        )
        resp.raise_for_status()
        cloudpickle.loads(resp.content)

    def close(self) -> None:
        with contextlib.suppress(AttributeError):
            self.client.close()
        _stop(self.proc)


def start_ray(tmp: str, actors: int, timeout: float) -> PeerProcess:
    """Ray in its own process (session directory under ``tmp``), ``actors`` actors up."""
    return PeerProcess(
        "Ray",
        [
            sys.executable,
            str(HERE / "_ray_peer.py"),
            "--actors",
            str(actors),
            "--temp-dir",
            os.path.join(tmp, "r"),
        ],
        start_timeout=timeout,
    )


def loopback_tcp_mbps(nbytes: int) -> float:
    """MB/s of ``nbytes`` sent over a fresh 127.0.0.1 socket pair into a reused buffer."""
    payload = memoryview(bytearray(nbytes))
    sink = memoryview(bytearray(1 << 20))
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
        with a, b:

            def drain() -> None:
                got = 0
                while got < nbytes:
                    n = b.recv_into(sink)
                    if n == 0:
                        break
                    got += n

            reader = threading.Thread(target=drain)
            reader.start()
            t = clock()
            a.sendall(payload)
            reader.join(120)
            if reader.is_alive():
                raise TimeoutError(
                    f"loopback TCP: the reader had not received {nbytes} bytes after 120 s"
                )
            return nbytes / (clock() - t) / MB


def run_timed(cmd: list[str], timeout: float, **kw: Any) -> tuple[int, str, float]:
    """Run ``cmd`` in its own session: (exit code, output, wall seconds); -1 if it ran past ``timeout``."""
    t = clock()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kw,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        wall = clock() - t
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:g}s", clock() - t
    finally:
        _stop(proc)  # after a timeout, or SIGTERM to the bench
    return proc.returncode, out, wall
