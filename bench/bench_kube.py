"""ktlite on a real Kubernetes cluster, through the API server's pod proxy, beside the raw floor.

    KUBECONFIG=... python bench/bench_kube.py --image ktlite-server:dev --pull-policy Never
    ... --loops          # also the issue-9 loops: 10,000 no-op calls, 1,000 with 1 MB arguments
    ... --json out.json

What it measures, all through the pod proxy (a client outside the cluster):

- warm call p50/p99 (no-op, 1 pod and 2 pods) beside a raw proxied ``GET`` of a tiny body from
  a plain uvicorn pod, the two interleaved call by call so that both see the same load;
- 100 MB up (the argument of a function returning None) and down (a result the function keeps
  in a global) beside a raw proxied ``POST`` / ``GET`` of the same size to the raw pod;
- cold ``.to()`` of 2 pods to the first result: the whole wall time, and the time from the
  later of the two servers' process start (its container's start; ``/health`` says when) to
  the first result;
- with ``--loops``: how many proxied calls fail in 10,000 no-op calls and in 1,000 calls with
  1 MB arguments (the requirement is none), with their p50.

It creates deployments named ``ktb-*`` and a pod ``ktb-raw`` in the namespace, and deletes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

import httpx
from _rounds import LoadLog

import ktlite as kt
from ktlite.backends.kube_api import KubeApi, load
from ktlite_wire.headers import TOKEN_HEADER, bearer

MB = 1_000_000
_BLOB: bytes | None = None

RAW_SERVER = """
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
BLOB = b"b" * 100_000_000
async def health(request):
    return Response(b"ok")
async def sink(request):
    n = 0
    async for chunk in request.stream():
        n += len(chunk)
    return Response(str(n).encode())
async def blob(request):
    return Response(BLOB[:int(request.query_params.get("n", "0"))])
app = Starlette(routes=[Route("/health", health), Route("/sink", sink, methods=["POST"]),
                        Route("/blob", blob)])
uvicorn.run(app, host="0.0.0.0", port=8080, log_level="warning", access_log=False)
"""


def noop(x: Any = None) -> None:
    return None


def size_of(x: Any) -> int:
    return len(x)


def blob(n: int) -> bytes:
    global _BLOB
    if _BLOB is None or len(_BLOB) != n:
        _BLOB = os.urandom(n)
    return _BLOB


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def us(s: float) -> str:
    return f"{s * 1e6:,.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.http, self.info = load()
        self.api = KubeApi(self.http, self.info.namespace)
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.data: dict[str, Any] = {}
        self.load = LoadLog()

    def compute(self, workers: int, **extra: Any) -> kt.Compute:
        c = kt.Compute(
            cpus="250m",
            memory="1Gi",
            backend="kubernetes",
            image=kt.Image(self.args.image),
            image_pull_policy=self.args.pull_policy,
            launch_timeout=300,
            stream_logs=False,
            tls=self.args.tls == "on",
            **extra,
        )
        return c.distribute("spmd", workers=workers) if workers > 1 else c

    def row(
        self, what: str, ours: float, peer: str, theirs: float | None, unit: str = "time"
    ) -> None:
        if unit == "time":
            ratio = f"{ours / theirs:.2f}" if theirs else ""
            self.rows.append((what, us(ours), peer, us(theirs) if theirs else "", ratio))
        else:
            ratio = f"{ours / theirs:.2f}" if theirs else ""
            self.rows.append(
                (what, f"{ours:,.0f} MB/s", peer, f"{theirs:,.0f} MB/s" if theirs else "", ratio)
            )
        self.data[what] = {"ktlite": ours, "peer": peer, "peer_value": theirs}

    # ---- the raw peer --------------------------------------------------------------------

    def start_raw(self) -> str:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "ktb-raw",
                "labels": {"app.kubernetes.io/managed-by": "ktlite-bench"},
            },
            "spec": {
                "containers": [
                    {
                        "name": "raw",
                        "image": self.args.image,
                        "imagePullPolicy": self.args.pull_policy,
                        "command": ["python", "-c", RAW_SERVER],
                        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
                    }
                ]
            },
        }
        self.api.delete("Pod", "ktb-raw")
        while self.api.get("Pod", "ktb-raw") is not None:
            time.sleep(0.5)
        self.api.create(pod)
        url = self.api.proxy_url("ktb-raw", 8080)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if self.http.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the raw peer pod did not answer within 180 s")

    # ---- measurements --------------------------------------------------------------------

    def warm(self, raw: str) -> None:
        n = self.args.calls
        for workers in (1, 2):
            remote = kt.fn(noop, name=f"ktb-warm{workers}").to(self.compute(workers))
            try:
                for _ in range(30):
                    remote()
                    self.http.get(f"{raw}/health")
                ours, theirs = [], []
                for _ in range(n):
                    t = time.perf_counter()
                    remote()
                    ours.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    self.http.get(f"{raw}/health").raise_for_status()
                    theirs.append(time.perf_counter() - t)
            finally:
                remote.teardown()
            for q, name in ((0.5, "p50"), (0.99, "p99")):
                self.row(
                    f"warm proxied call {name} ({workers} pod{'s' if workers > 1 else ''})",
                    pct(ours, q),
                    "raw proxied GET",
                    pct(theirs, q),
                )

    def transfers(self, raw: str) -> None:
        payload = os.urandom(100 * MB)
        up = kt.fn(size_of, name="ktb-up").to(self.compute(1, memory_limit="2Gi"))
        down = kt.fn(blob, name="ktb-down").to(self.compute(1, memory_limit="2Gi"))
        try:
            down(100 * MB)  # builds the blob once
            best = {"up": 0.0, "down": 0.0, "raw up": 0.0, "raw up chunked": 0.0, "raw down": 0.0}
            for _ in range(3):
                t = time.perf_counter()
                assert up(payload) == len(payload)
                best["up"] = max(best["up"], 100 / (time.perf_counter() - t))
                t = time.perf_counter()
                assert len(down(100 * MB)) == 100 * MB
                best["down"] = max(best["down"], 100 / (time.perf_counter() - t))
                t = time.perf_counter()
                r = self.http.post(f"{raw}/sink", content=payload, timeout=120)
                assert r.text == str(len(payload)), r.text
                best["raw up"] = max(best["raw up"], 100 / (time.perf_counter() - t))
                t = time.perf_counter()  # the same body chunked, as ktlite sends it
                r = self.http.post(
                    f"{raw}/sink",
                    content=iter([payload[i : i + MB] for i in range(0, len(payload), MB)]),
                    timeout=120,
                )
                assert r.text == str(len(payload)), r.text
                best["raw up chunked"] = max(
                    best["raw up chunked"], 100 / (time.perf_counter() - t)
                )
                t = time.perf_counter()
                r = self.http.get(f"{raw}/blob", params={"n": 100 * MB}, timeout=120)
                assert len(r.content) == 100 * MB
                best["raw down"] = max(best["raw down"], 100 / (time.perf_counter() - t))
        finally:
            up.teardown()
            down.teardown()
        self.row(
            "100 MB argument (up)", best["up"], "raw proxied POST", best["raw up"], unit="MB/s"
        )
        self.row(
            "100 MB argument (up)",
            best["up"],
            "raw proxied POST, chunked",
            best["raw up chunked"],
            unit="MB/s",
        )
        self.row(
            "100 MB result (down)", best["down"], "raw proxied GET", best["raw down"], unit="MB/s"
        )

    def cold(self) -> None:
        walls, after_start = [], []
        for _ in range(self.args.cold):
            name = f"ktb-cold-{uuid.uuid4().hex[:6]}"
            t0 = time.time()
            remote = kt.fn(noop, name=name).to(self.compute(2))
            try:
                remote()
                done = time.time()
                # /health says when the server started to the deployment's token only
                token = {TOKEN_HEADER: bearer(remote.deployment.applied.token)}
                started = max(
                    s["started"]
                    for s in (
                        self.http.get(f"{ep.url}/health", headers=token).json()
                        for ep in remote.deployment.endpoints
                    )
                )
            finally:
                remote.teardown()
            walls.append(done - t0)
            after_start.append(done - started)
        self.row("cold .to() of 2 pods -> first result", statistics.median(walls), "", None)
        self.row(
            "  of which after the later container started",
            statistics.median(after_start),
            "target",
            1.0,
        )

    def loops(self) -> None:
        remote = kt.fn(noop, name="ktb-loop").to(self.compute(2))
        try:
            for label, n, arg in (
                ("no-op", 10_000, None),
                ("1 MB argument", 1_000, os.urandom(MB)),
            ):
                fails, lat = [], []
                for i in range(n):
                    t = time.perf_counter()
                    try:
                        remote(arg)
                    except kt.KtliteError as e:
                        fails.append(f"{i}: {type(e).__name__}: {str(e)[:200]}")
                    lat.append(time.perf_counter() - t)
                self.data[f"loop {label}"] = {
                    "calls": n,
                    "failed": len(fails),
                    "p50": pct(lat, 0.5),
                    "p99": pct(lat, 0.99),
                    "errors": fails[:5],
                }
                self.rows.append(
                    (
                        f"{n:,} proxied calls, {label}: failed",
                        str(len(fails)),
                        f"p50 {us(pct(lat, 0.5))}",
                        f"p99 {us(pct(lat, 0.99))}",
                        "",
                    )
                )
                for line in fails[:3]:
                    print(f"  failure {line}", file=sys.stderr)
        finally:
            remote.teardown()

    def run(self) -> None:
        t0 = time.monotonic()
        raw = self.start_raw()
        try:
            steps = [
                ("warm calls", lambda: self.warm(raw)),
                ("transfers", lambda: self.transfers(raw)),
                ("cold starts", self.cold),
                *([("loops", self.loops)] if self.args.loops else []),
            ]
            for name, step in steps:
                with self.load.step(name):
                    step()
        finally:
            self.api.delete("Pod", "ktb-raw")
        head = (
            f"ktlite {kt.__version__} on Kubernetes ({self.info.host}), through the pod proxy, "
            f"{time.monotonic() - t0:.0f} s; {self.args.calls} calls per latency; ratio = ktlite / peer"
        )
        print(head)
        print(self.load.summary())
        widths = [
            max(
                len(r[i])
                for r in self.rows + [("measurement", "ktlite", "peer", "peer value", "ratio")]
            )
            for i in range(5)
        ]
        for r in [
            ("measurement", "ktlite", "peer", "peer value", "ratio"),
            tuple("-" * w for w in widths),
            *self.rows,
        ]:
            print(
                "  ".join(
                    c.ljust(w) if i in (0, 2) else c.rjust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=True))
                )
            )
        print("load average (1 min) before -> after each step:")
        for line in self.load.lines():
            print(f"  {line}")
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump({**self.data, "load": self.load.as_json()}, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default="ktlite-server:dev")
    p.add_argument("--pull-policy", default="IfNotPresent")
    p.add_argument("--calls", type=int, default=300, help="calls per latency measurement")
    p.add_argument("--cold", type=int, default=3, help="cold starts to take the median of")
    p.add_argument("--loops", action="store_true", help="also the 10,000 / 1,000 call loops")
    p.add_argument(
        "--tls", choices=("on", "off"), default="on", help="the pods serve TLS (the default) or not"
    )
    p.add_argument("--json", metavar="PATH")
    Bench(p.parse_args()).run()


if __name__ == "__main__":
    main()
