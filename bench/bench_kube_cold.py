"""Cold ``.to()`` of N pods on a real Kubernetes cluster, and what it asks of the API server.

    KUBECONFIG=... python bench/bench_kube_cold.py --image python:3.11-slim --pods 2,8,32
    ... --json out.json

For each N, a fresh deployment of N pods (``cpus=50m``, ``memory=256Mi``: the pods are
small, the count is what is measured), a no-op call on every pod, then teardown. Columns:

- ``.to() s``: the wall time of ``.to()`` (objects, containers starting, readiness, code
  push); ``1st call s``: the first call after it;
- ``last start s``: when the last pod's server process started, from ``.to()``'s start
  (each pod's ``/health`` says when its server started, asked after the timing);
  ``after s``: ``.to()``'s end less that: what ktlite spends once every container runs
  (issue 26: "cold ``.to()`` of N pods is bounded by the containers' start, not by ktlite");
  on a small node it includes the pods' own start-up CPU (about 0.75 CPU-seconds per pod
  here: the bootstrap, the server's imports, its first rank process), which N pods share;
- ``last Ready s``: when the last pod's ``Ready`` condition turned true (the kubelet's
  readiness probe, every second), from ``.to()``'s start; whole seconds (the API's
  resolution);
- ``API`` and ``proxy``: the requests this process sent during ``.to()`` to the API server
  itself and through its pod proxy (``.../proxy/...``), counted at the HTTP client;
  ``by kind``: the API requests by verb and resource;
- ``teardown s``: ``remote.teardown()``.

The cluster's own limits show at larger N (one node's kubelet starts containers a few at a
time): the ``last start`` column is that, and not ktlite.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import uuid
from collections import Counter
from datetime import datetime
from typing import Any

import httpx
from _rounds import LoadLog

import ktlite as kt
from ktlite.backends.kube_api import load
from ktlite_wire.headers import TOKEN_HEADER, bearer

_counts: Counter[str] = Counter()
_send = httpx.Client.send


def _counting_send(self: httpx.Client, request: httpx.Request, **kw: Any) -> httpx.Response:
    path = request.url.path
    if "/proxy" in path:
        _counts["proxy"] += 1
    else:
        kind = re.sub(r"^/(api|apis/[^/]+)/v1/", "", path)
        kind = re.sub(r"namespaces/[^/]+/", "", kind)
        parts = kind.split("/")
        resource = parts[0] if parts else "?"
        verb = request.method if len(parts) > 1 else f"{request.method}-all"
        if "watch=" in str(request.url.query):
            verb = "WATCH"
        _counts[f"{verb} {resource}"] += 1
    return _send(self, request, **kw)


def noop() -> None:
    return None


def one(n: int, args: argparse.Namespace, http: httpx.Client, namespace: str) -> dict[str, Any]:
    compute = kt.Compute(
        cpus="50m",
        memory="256Mi",
        backend="kubernetes",
        image=kt.Image(args.image),
        image_pull_policy=args.pull_policy,
        launch_timeout=600,
        stream_logs=False,
    )
    if n > 1:
        compute = compute.distribute("spmd", workers=n)
    name = f"ktb-cold{n}-{uuid.uuid4().hex[:5]}"
    _counts.clear()
    t0 = time.time()
    remote = kt.fn(noop, name=name).to(compute)
    to_s = time.time() - t0
    counts = dict(_counts)
    try:
        t1 = time.time()
        remote()
        call_s = time.time() - t1
        token = {TOKEN_HEADER: bearer(remote.deployment.applied.token)}
        started = max(
            http.get(f"{ep.url}/health", headers=token).json()["started"]
            for ep in remote.deployment.endpoints
        )
        pods = http.get(
            f"/api/v1/namespaces/{namespace}/pods",
            params={"labelSelector": f"ktlite.dev/name={name}"},
        ).json()["items"]
        ready = max(
            datetime.fromisoformat(c["lastTransitionTime"].replace("Z", "+00:00")).timestamp()
            for p in pods
            for c in p["status"]["conditions"]
            if c["type"] == "Ready"
        )
    finally:
        t2 = time.time()
        remote.teardown()
        teardown_s = time.time() - t2
    api = {k: v for k, v in counts.items() if k != "proxy"}
    return {
        "pods": n,
        "to_s": to_s,
        "call_s": call_s,
        "last_start_s": started - t0,
        "after_s": to_s - (started - t0),
        "last_ready_s": ready - t0,
        "api": sum(api.values()),
        "proxy": counts.get("proxy", 0),
        "by_kind": api,
        "teardown_s": teardown_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default="ktlite-server:dev")
    p.add_argument("--pull-policy", default="IfNotPresent")
    p.add_argument("--pods", default="2,8,32", help="comma-separated pod counts")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    http, info = load()
    httpx.Client.send = _counting_send  # type: ignore[method-assign]
    load_log = LoadLog()
    rows = []
    with load_log.step("warm-up"):
        one(1, args, http, info.namespace)  # the first deploy makes the namespace's shared Secrets
    for n in (int(x) for x in args.pods.split(",")):
        with load_log.step(f"{n} pods"):
            rows.append(one(n, args, http, info.namespace))
    print(f"ktlite {kt.__version__}, cold .to() on {info.host}; image {args.image}")
    print(load_log.summary())
    head = (
        "pods",
        ".to() s",
        "1st call s",
        "last start s",
        "after s",
        "last Ready s",
        "API",
        "proxy",
        "teardown s",
    )
    print("  ".join(f"{h:>12}" for h in head) + "  by kind")
    for r in rows:
        cells = (
            r["pods"],
            f"{r['to_s']:.2f}",
            f"{r['call_s']:.3f}",
            f"{r['last_start_s']:.2f}",
            f"{r['after_s']:.2f}",
            f"{r['last_ready_s']:.0f}",
            r["api"],
            r["proxy"],
            f"{r['teardown_s']:.2f}",
        )
        kinds = ", ".join(
            f"{k} {v}" for k, v in sorted(r["by_kind"].items(), key=lambda kv: -kv[1])
        )
        print("  ".join(f"{c:>12}" for c in cells) + "  " + kinds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load": load_log.as_json()}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
