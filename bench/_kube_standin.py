"""The stand-in cluster of ``bench_kube_scale.py``: the fake API server (``tests/kube_fake.py``)
metering its own CPU and the bytes it answers (a watch's as the client reads them), a fake clock
that notes when it reached each time, each pod's scripted life, and stub pod servers behind the
pod proxy (``/health``, ``/deploy``, ``/status``, ``/restart_failed``; no ranks). Import it after ``tests/`` is on ``sys.path`` (the bench puts it there)."""

from __future__ import annotations

import platform
import threading
import time
from typing import Any

import httpx
import kube_fake as kf

from ktlite_wire.calltree import LaunchRelay
from ktlite_wire.headers import TREE_HEADER
from ktlite_wire.outcome import CallResult
from ktlite_wire.version import PROTOCOL_VERSION

# each pod: ContainerCreating at 1 s, its container running at 4-7.5 s (by ordinal), Ready 2 s
# later; its server answers 0.5 s after the container runs; a deleted pod Terminating for 2 s
CREATING_S, RUNNING_S, SPREAD_S, PROBE_S, SERVER_UP_S, TERMINATING_S = 1.0, 4.0, 0.5, 2.0, 0.5, 2.0


class StandIn(kf.FakeKube):
    """The fake API server, counting its own CPU time and the bytes it answers."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.cpu_s = 0.0  # CPU seconds its threads spent in it (thread_time: not lock waits)
        self.resp_bytes = 0
        self._meter = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        cpu = time.thread_time()
        try:
            response = super().handle_request(request)
            if request.url.params.get("watch") == "true":  # read as the client reads it
                return httpx.Response(
                    response.status_code,
                    headers=response.headers,
                    stream=Metered(self, response.stream),  # type: ignore[arg-type]
                )
            if "/proxy" not in request.url.path:  # the API server's own answer, not a pod's
                size = len(response.read())
                with self._meter:
                    self.resp_bytes += size
            return response
        finally:
            with self._meter:
                self.cpu_s += time.thread_time() - cpu

    def count(self, cpu_s: float, size: int) -> None:
        with self._meter:
            self.cpu_s += cpu_s
            self.resp_bytes += size


class Metered(httpx.SyncByteStream):
    """A watch's body: its bytes, and the stand-in's CPU producing each chunk, counted."""

    def __init__(self, fake: StandIn, inner: Any) -> None:
        self.fake, self.inner = fake, inner

    def __iter__(self) -> Any:
        chunks = iter(self.inner)
        while True:
            cpu = time.thread_time()
            try:
                chunk = next(chunks)
            except StopIteration:
                self.fake.count(time.thread_time() - cpu, 0)
                return
            self.fake.count(time.thread_time() - cpu, len(chunk))
            yield chunk

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class MarkedClock(kf.FakeClock):
    """The fake clock, noting the real time at which it reached each value."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[tuple[float, float]] = [(0.0, time.perf_counter())]

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        self.marks.append((self.now, time.perf_counter()))

    def reached(self, at: float) -> float:
        """The real time the clock first reached ``at``."""
        return next(wall for t, wall in self.marks if t >= at)


def ordinal(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def running_at(name: str) -> float:
    """Fake seconds after its creation when a pod's container runs (spread over 8 values)."""
    return RUNNING_S + (ordinal(name) % 8) * SPREAD_S


def script(pod: dict[str, Any]) -> kf.PodScript:
    run = running_at(pod["metadata"]["name"])
    return [
        (0.0, kf.pending()),
        (CREATING_S, kf.container_creating()),
        (run, kf.running_not_ready()),
        (run + PROBE_S, kf.ready()),
    ]


class StubServers(dict):  # type: ignore[type-arg]
    """The fake's proxy table: every pod's stub server, answering from SERVER_UP_S after its
    container runs (on the fake clock)."""

    def __init__(self, fake: StandIn, clock: kf.FakeClock) -> None:
        super().__init__()
        self.fake, self.clock = fake, clock

    def up(self, name: str) -> bool:
        """Whether the pod's stub server accepts connections (its script's start, as the fake
        times it, plus the container's start and the server's)."""
        pod = self.fake._store.get(("pods", "default", name))
        meta = self.fake._pods.get(pod["metadata"]["uid"]) if pod else None
        return meta is not None and self.clock() >= meta.start + running_at(name) + SERVER_UP_S

    def get(self, key: Any, default: Any = None) -> Any:
        name = key[0]

        def answer(request: httpx.Request) -> httpx.Response:
            if not self.up(name):
                raise httpx.ConnectError("connection refused")
            if request.url.path == "/health":
                body = {
                    "status": "ok",
                    "protocol": PROTOCOL_VERSION,
                    "python": platform.python_version(),
                    "pod": name,
                }
                return httpx.Response(200, json=body)
            if request.url.path == "/deploy":
                request.read()
                return httpx.Response(200, content=CallResult([]).encode_bytes())
            if request.url.path in ("/status", "/restart_failed"):
                # with x-ktlite-tree pod 0 answers for every pod it names (the gathering down
                # the tree is not run here: the stubs hold no ranks); else for itself
                header = request.headers.get(TREE_HEADER)
                names = [name] if header is None else LaunchRelay.decode(header).names
                table = [_entry(n, request.url.path) for n in names]
                return httpx.Response(200, json=table if header is not None else table[0])
            return httpx.Response(404, json={"detail": "not in the stub"})

        return answer


def _entry(name: str, path: str) -> dict[str, Any]:
    """A stub pod's answer to ``/status`` (one idle rank) or ``/restart_failed`` (nothing)."""
    if path == "/restart_failed":
        return {"pod": name, "ordinal": ordinal(name), "restarted": [], "failed": []}
    rank = {"rank": ordinal(name), "state": "idle", "calls": [], "targets": []}
    return {"pod": name, "ordinal": ordinal(name), "ranks": [rank], "colocated": []}
