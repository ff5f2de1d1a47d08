"""Helpers for the pod-death, timeout, cancellation and duplicate-delivery fault tests.

``beat`` is the function the deployments run: every rank records that it started (one line
per attempt) and then appends a timestamped heartbeat line to its own file every 50 ms, so
a test can tell from outside, without asking the server, whether a rank still runs the
call and when it stopped. The rest are test-side helpers: process liveness, waiting, the
local backend's state file. Clock: ``time.monotonic()``, which is system-wide on Linux, so
timestamps written by rank processes compare with the test's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ktlite.backends.processes import pid_alive  # noqa: F401  (the tests use it from here)
from ktlite_wire.headers import TOKEN_HEADER, VERSION_HEADER, bearer
from ktlite_wire.version import PROTOCOL_VERSION

BEAT_S = 0.05


def beat(dirpath: str, tag: str, seconds: float, quick: Iterable[int] = (), nbytes: int = 0) -> Any:
    """Record the attempt, then beat for ``seconds`` (ranks in ``quick`` return at once).
    Returns the rank, or ``nbytes`` bytes when asked (past shm.INLINE_MAX: a result that
    waits in a shared-memory file)."""
    rank = int(os.environ["RANK"])
    d = Path(dirpath)
    with open(d / f"{tag}-r{rank}.start", "a") as f:
        f.write(f"{os.getpid()} {time.monotonic()}\n")
    if rank not in set(quick):
        path = d / f"{tag}-r{rank}.beat"
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with open(path, "a") as f:
                f.write(f"{time.monotonic()} {os.getpid()}\n")
            time.sleep(BEAT_S)
    return bytes([65 + rank]) * nbytes if nbytes else rank


def rank_of() -> int:
    return int(os.environ["RANK"])


# ---- test side ---------------------------------------------------------------------------------


class Call:
    """A call running in a background thread; records how and when (monotonic) it ended."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.ended: float | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self.value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e
        self.ended = time.monotonic()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    """Poll ``pred`` until it returns something truthy; that value, or None at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def starts(d: Path, tag: str, rank: int) -> list[tuple[int, float]]:
    """Every attempt rank ``rank`` made at call ``tag``: (pid, start time)."""
    path = d / f"{tag}-r{rank}.start"
    if not path.exists():
        return []
    return [
        (int(p), float(t)) for p, t in (ln.split() for ln in path.read_text().splitlines() if ln)
    ]


def beats(d: Path, tag: str, rank: int) -> list[tuple[float, int]]:
    path = d / f"{tag}-r{rank}.beat"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:  # a line being written is skipped
            out.append((float(parts[0]), int(parts[1])))
    return out


def all_beating(d: Path, tag: str, ranks: Iterable[int]) -> bool:
    return all(beats(d, tag, r) for r in ranks)


def last_beat_after_quiet(
    d: Path, tag: str, rank: int, quiet: float = 1.0, timeout: float = 20.0
) -> float | None:
    """Wait until rank ``rank`` has written no beat for ``quiet`` seconds; its last beat's
    time, or None when it still beats at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = beats(d, tag, rank)
        last = got[-1][0] if got else 0.0
        if time.monotonic() - last >= quiet:
            return last
        time.sleep(0.05)
    return None


def local_state(name: str) -> dict[str, Any]:
    path = Path(os.environ["KTLITE_HOME"]) / "local" / name / "state.json"
    with open(path) as f:
        state: dict[str, Any] = json.load(f)
    state["urls"] = [f"http://127.0.0.1:{p['port']}" for p in state["pods"]]
    return state


def refuses(url: str) -> bool:
    """Nothing listens at ``url`` any more. A killed pod server's process shows as a zombie
    while its other threads still exit and hold its sockets: only then are they closed."""
    host, _, port = url.rpartition("//")[2].partition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def signal_quietly(pid: int | None, sig: int) -> None:
    if pid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped (bounded)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
        return False

    assert wait_for(stopped, timeout), f"process {pid} was not stopped {timeout:g} s after SIGSTOP"


def release(pids: Iterable[int]) -> None:
    """Cleanup for stopped processes: kill them (a stopped process takes SIGKILL)."""
    for pid in pids:
        signal_quietly(pid, signal.SIGKILL)
        signal_quietly(pid, signal.SIGCONT)


def report(what: str, seconds: float, bound: float) -> None:
    """One measured time, shown with ``pytest -s`` (or ``-rA``, with the test's output)."""
    print(f"\n[fault timing] {what}: {seconds:.3f}s (bound {bound:g}s)", flush=True)


def recover(name: str, stopped: Iterable[int] = ()) -> None:
    """Finalizer: resume processes a test stopped; a deployment left unhealthy or still busy
    (a test that failed half-way) is torn down so the next test starts from scratch."""
    import httpx

    from ktlite.backends.local import LocalBackend

    for pid in stopped:
        signal_quietly(pid, signal.SIGCONT)
    try:
        state = local_state(name)
    except (OSError, ValueError):
        return
    headers = {TOKEN_HEADER: bearer(state["token"]), VERSION_HEADER: str(PROTOCOL_VERSION)}

    def idle() -> bool:
        with httpx.Client(timeout=2.0) as client:
            for url in state["urls"]:
                try:
                    if client.get(f"{url}/status", headers=headers).json()["active_calls"]:
                        return False
                except (httpx.HTTPError, ValueError, KeyError):
                    return False
        return True

    if not wait_for(idle, 5.0, interval=0.2):
        LocalBackend.shared().teardown(name, timeout=5.0)


class Proxy:
    """A TCP proxy to ``127.0.0.1:port`` whose live connections a test can break (RST), as
    a network fault between two pods that both stay alive would."""

    def __init__(self, port: int) -> None:
        import socket

        self.target = port
        self._lock = threading.Lock()
        self._socks: list[Any] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: Any, dst: Any) -> None:
        import socket

        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def break_all(self) -> None:
        """Reset every connection through the proxy now (new ones still get through)."""
        import socket
        import struct

        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.close()
        self.break_all()
