"""The Kubernetes backend at 8 to 1,000 pods, against the stand-in API server: how many API
requests, and how much time, each step of a deployment's life takes (issue 26, item 3).

    python bench/bench_kube_scale.py                        # 8, 64, 256 and 1,000 pods
    python bench/bench_kube_scale.py --pods 8,64 --json out.json

What is real and what is simulated:

- real: ``KubernetesBackend`` (``lookup``, ``apply`` with its readiness wait, ``logs``,
  ``teardown`` with ``volumes=True``) and ``Deployment`` (``push``, the code push; ``status``;
  ``restart_failed``; ``colocate``, a colocation push), each unchanged, over an
  ``httpx.Client`` as in ``tests/test_kube_backend.py``; the deployment has one volume;
- the API server is ``tests/kube_fake.py`` in-process (an httpx transport) on a fake clock:
  the backend's ``sleep`` advances that clock, and a watch that waits moves it to the next
  scripted change (``tests/kube_fake_watch.py``), so no wait takes real time. Each pod's
  script: Pending, ContainerCreating at 1 s, its container running (not Ready) at 4-7.5 s
  (spread by ordinal), Ready at 2 s after that; a deleted pod stays Terminating for 2 s;
- the pod servers are stubs behind the fake's pod proxy: ``GET /health`` answers (with the
  protocol and this Python) from 0.5 s after the container runs, before that the proxy says
  "connection refused" (503); ``POST /deploy`` answers an empty result; ``GET /status`` and
  ``POST /restart_failed`` answer for every pod the ``x-ktlite-tree`` header names (pod 0's
  gathering down the tree is not run: ``bench_scale.py`` runs the tree on real pod servers),
  else for the pod. So these steps count the client's requests but no pod loads code.

Columns: ``requests`` counted by the stand-in (``FakeKube.requests``), by verb and resource
(``LIST`` a collection GET, ``GET proxy /health`` a request through the pod proxy);
``resp MB`` the bytes of the API server's answers (not the proxied pods'); ``wall s`` real
seconds of the step (the stand-in's time included); ``client CPU s`` this process's CPU time
less the stand-in's (what ktlite itself spent); ``stand-in CPU s`` CPU seconds inside the
stand-in (the fake's own cost, which a real API server would not charge to the client);
``fake-clock s`` simulated seconds the step waited (its sleeps on the fake clock), no real
time. A warm-up deployment of 2 pods runs first, unreported (the first deploy builds the
source it ships). The redeploy comes 60 fake seconds after the code push, when every pod is
Ready (within the readiness probe's window, a redeploy's wait asks each pod that is not
Ready yet for /health again: ``wait_ready`` keeps no memory of the pods that answered).

Watches are served as a v1.31 API server serves them (chunked JSON lines, bookmarks, 410,
``timeoutSeconds``); their bytes count in ``resp MB``. LISTs page as a real API server pages
them when asked with ``limit`` (ktlite asks 500 at a time: 2 pages at 1,000 pods). The fake has
no API priority and fairness, and a request costs it far more than a real API server (it recomputes
every pod's status on each request), so ``stand-in s`` is not a prediction of a real cluster's
latency.

Cold ``.to()``: the time from the last container's start to ``.to()`` returning, in three
parts: the scripted server start and readiness probe (simulated, ``PROBE_S``), ktlite's own
time from the moment the stand-in's clock reached the last pod's Ready to ``apply`` returning
(real seconds, the stand-in's work to deliver the events included), and the code push (real).
"""

from __future__ import annotations

import argparse
import atexit
import io
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_HOME = tempfile.mkdtemp(prefix="ktlite-bench-kscale-")
os.environ["KTLITE_HOME"] = _HOME  # before ktlite is imported: never share the tests' deployments
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the stand-in API server lives with the tests

import cloudpickle  # noqa: E402
import httpx  # noqa: E402
import kube_fake as kf  # noqa: E402
from _kube_standin import (  # noqa: E402
    PROBE_S,
    TERMINATING_S,
    MarkedClock,
    StandIn,
    StubServers,
    running_at,
    script,
)
from _rounds import LoadLog  # noqa: E402

import ktlite as kt  # noqa: E402
from ktlite.backends.kube_api import ClusterInfo  # noqa: E402
from ktlite.backends.kubernetes import KubernetesBackend  # noqa: E402
from ktlite.modes.deploy import Deployment  # noqa: E402
from ktlite.specs.deployment_spec import DeploymentSpec  # noqa: E402

HOST = "https://fake-apiserver"
API_TOKEN = "bench-api-token"
TOKEN = "bench-call-token-0123456789abcdef"
NAME = "scale"
IDLE_S = 60.0  # fake seconds between the code push and the redeploy

STEPS = (
    "deploy: objects",
    "deploy: readiness wait",
    "code push",
    "status",
    "restart_failed",
    "colocation push",
    "logs, every pod",
    "redeploy, no change",
    "teardown, volumes too",
)

TARGET_TAIL_S = (
    1.0  # ktlite's own time after the last pod is Ready, for "bounded by the containers"
)

# Where the requests that grow with the pod count come from (read from the code, issue 26).
CAUSES = {
    ("logs, every pod", "GET pod/log"): (
        "kube_logs.pod_logs: the Kubernetes log API is per pod (the kubelet of each pod's node "
        "serves it) and a pod server cannot read another container's log: one request per pod, "
        "16 at a time, printed in ordinal order"
    ),
    ("code push", "GET proxy /health"): (
        "Fanout.load (modes/fanout.py) -> Deployment.wait_healthy: one GET /health per pod "
        "through the pod proxy before its launch"
    ),
    ("code push", "POST proxy /deploy"): (
        "Fanout.load -> PodClient.deploy (net/client.py): one POST /deploy per pod through "
        "the pod proxy (pod 0 could push to the others instead: issue 26, item 2)"
    ),
}

_API_PATH = re.compile(
    r"/(?:api/v1|apis/[^/]+/[^/]+)(?:/namespaces/[^/]+)?/([^/]+)(?:/([^/]+)(?:/(.*))?)?"
)
_SHORT = {"persistentvolumeclaims": "pvc", "networkpolicies": "networkpolicy"}


def kind_of(req: kf.RecordedRequest) -> str:
    """``LIST pod``, ``WATCH pod``, ``GET secret``, ``DELETE pod``, ``GET proxy /health``, ..."""
    m = _API_PATH.fullmatch(req.path)
    if m is None:
        return f"{req.method} {req.path}"
    plural, name, sub = m.groups()
    if sub is not None and sub.split("/", 1)[0] == "proxy":
        return f"{req.method} proxy /{sub.split('/', 1)[1] if '/' in sub else ''}"
    res = _SHORT.get(plural, plural[:-1] if plural.endswith("s") else plural)
    if name is None:
        watch = req.query.get("watch") in ("true", "1")
        verb = {"GET": "WATCH" if watch else "LIST", "DELETE": "DELETECOLLECTION"}
        verb = verb.get(req.method, req.method)
    else:
        verb = req.method
    return f"{verb} {res}" + (f"/{sub}" if sub else "")


class Meter:
    """Snapshots of the counters; a step is the difference of two."""

    def __init__(self, fake: StandIn, clock: kf.FakeClock) -> None:
        self.fake, self.clock = fake, clock

    def snap(self) -> dict[str, Any]:
        return {
            "at": len(self.fake.requests),
            "wall": time.perf_counter(),
            "cpu": time.process_time(),
            "standin_cpu": self.fake.cpu_s,
            "fake_clock": self.clock(),
            "resp": self.fake.resp_bytes,
        }

    def diff(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        kinds = Counter(kind_of(r) for r in self.fake.requests[a["at"] : b["at"]])
        standin_cpu = b["standin_cpu"] - a["standin_cpu"]
        return {
            "requests": b["at"] - a["at"],
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
            "resp_mb": (b["resp"] - a["resp"]) / 1e6,
            "wall_s": b["wall"] - a["wall"],
            "client_cpu_s": (b["cpu"] - a["cpu"]) - standin_cpu,
            "standin_cpu_s": standin_cpu,
            "fake_clock_s": b["fake_clock"] - a["fake_clock"],
        }


def minus(total: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    out = {k: total[k] - part[k] for k in total if k != "by_kind"}
    kinds = Counter(total["by_kind"]) - Counter(part["by_kind"])
    out["by_kind"] = dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    return out


def noop() -> None:
    return None


def run_one(n: int, load: LoadLog) -> dict[str, dict[str, Any]]:
    """Every step for one deployment of ``n`` pods, on a fresh stand-in."""
    clock = MarkedClock()
    fake = StandIn(
        token=API_TOKEN,
        pod_behavior=script,
        clock=clock,
        pod_termination_seconds=TERMINATING_S,
    )
    fake.proxy_handlers = StubServers(fake, clock)
    http = httpx.Client(
        transport=fake, base_url=HOST, headers={"authorization": f"Bearer {API_TOKEN}"}
    )
    backend = KubernetesBackend(
        http,
        ClusterInfo(HOST, "stand-in", "default", False),
        out=io.StringIO(),  # its progress lines, not shown
        clock=clock,
        sleep=clock.advance,
    )
    meter = Meter(fake, clock)
    waits: list[tuple[dict[str, Any], dict[str, Any]]] = []
    wait_ready = backend.wait_ready

    def timed_wait(*args: Any, **kwargs: Any) -> Any:  # the readiness wait inside apply
        start = meter.snap()
        try:
            return wait_ready(*args, **kwargs)
        finally:
            waits.append((start, meter.snap()))

    backend.wait_ready = timed_wait  # type: ignore[method-assign]
    compute = kt.Compute(
        backend="kubernetes", launch_timeout=600, volumes=[kt.Volume("scratch", size="1Gi")]
    ).distribute(workers=n)
    spec = DeploymentSpec(NAME, compute.pod_spec())
    rows: dict[str, dict[str, Any]] = {}

    def deploy() -> Any:  # what .to() asks the backend: lookup, then apply
        found = backend.lookup(NAME)
        return backend.apply(spec, found.token if found is not None else TOKEN)

    try:
        with load.step(f"deploy {n}"):
            a = meter.snap()
            applied = deploy()
            total = meter.diff(a, meter.snap())
        wait = meter.diff(*waits[-1])
        rows["deploy: objects"] = minus(total, wait)
        rows["deploy: readiness wait"] = wait
        if len(applied.endpoints) != n:
            raise RuntimeError(f"the deploy reported {len(applied.endpoints)} pods, not {n}")

        applied_at = time.perf_counter()
        dep = Deployment(spec, backend, applied)
        with load.step(f"push {n}"):
            a = meter.snap()
            dep.push(cloudpickle.dumps(noop), {}, None)
            rows["code push"] = meter.diff(a, meter.snap())
        with load.step(f"status {n}"):
            a = meter.snap()
            if len(dep.status()) != n:
                raise RuntimeError(f"status reported other than {n} pods")
            rows["status"] = meter.diff(a, meter.snap())
        with load.step(f"restart_failed {n}"):
            a = meter.snap()
            if len(dep.restart_failed()["pods"]) != n:
                raise RuntimeError(f"restart_failed answered for other than {n} pods")
            rows["restart_failed"] = meter.diff(a, meter.snap())
        with load.step(f"colocate {n}"):
            a = meter.snap()
            dep.colocate("helper", "fn", cloudpickle.dumps(noop), {}, None)
            rows["colocation push"] = meter.diff(a, meter.snap())
        with load.step(f"logs {n}"):
            a = meter.snap()
            for _ in backend.logs(NAME):
                pass
            rows["logs, every pod"] = meter.diff(a, meter.snap())
        last_start = max(running_at(f"{NAME}-{i}") for i in range(n))
        rows["cold .to()"] = {
            "last_container_start_s": last_start,
            "probe_s": PROBE_S,  # simulated: server start and readiness probe
            "after_ready_s": applied_at - clock.reached(last_start + PROBE_S),
            "push_s": rows["code push"]["wall_s"],
        }

        clock.advance(IDLE_S)  # a later .to(): every pod Ready by then (see the docstring)
        with load.step(f"redeploy {n}"):
            a = meter.snap()
            again = deploy()
            rows["redeploy, no change"] = meter.diff(a, meter.snap())
        if again.restarted:
            raise RuntimeError(f"a redeploy with no change restarted pods {again.restarted}")

        with load.step(f"teardown {n}"):
            a = meter.snap()
            backend.teardown(NAME, timeout=60.0, volumes=True)
            rows["teardown, volumes too"] = meter.diff(a, meter.snap())
    finally:
        http.close()
    return rows


def short(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 10_000 else str(n)


def growth(results: dict[int, dict[str, dict[str, Any]]], step: str) -> dict[str, Any]:
    """O(1) or O(N) for a step's requests: the extra requests per extra pod, overall and per
    kind, between the smallest and the largest pod count."""
    lo, hi = min(results), max(results)
    a, b = results[lo][step], results[hi][step]
    per_pod = (b["requests"] - a["requests"]) / (hi - lo) if hi > lo else 0.0
    kinds = {
        k: round((b["by_kind"].get(k, 0) - a["by_kind"].get(k, 0)) / (hi - lo), 2)
        for k in b["by_kind"]
        if hi > lo and (b["by_kind"].get(k, 0) - a["by_kind"].get(k, 0)) / (hi - lo) >= 0.05
    }
    return {
        "per_pod": round(per_pod, 2),
        "order": "n/a" if hi == lo else "O(N)" if per_pod >= 0.05 else "O(1)",  # one size: none
        "growing_kinds": kinds,
        "causes": {k: CAUSES.get((step, k), "") for k in kinds},
    }


def cold(results: dict[int, dict[str, dict[str, Any]]]) -> list[str]:
    """The cold ``.to()`` after the last container's start, per size, and its target."""
    lines = []
    for n in sorted(results):
        c = results[n]["cold .to()"]
        ktlite = c["after_ready_s"] + c["push_s"]
        met = "met" if ktlite <= TARGET_TAIL_S else "not met"
        why = (
            ""
            if ktlite <= TARGET_TAIL_S
            else " (cause: "
            + (
                "the code push, one /health and one /deploy per pod through the proxy: "
                "issue 26 item 2's tree"
                if c["push_s"] > c["after_ready_s"]
                else "the readiness wait's tail"
            )
            + ")"
        )
        lines.append(
            f"  {n:>5} pods: last container start at {c['last_container_start_s']:.1f} s "
            f"(simulated); then {c['probe_s']:.1f} s server start and readiness probe "
            f"(simulated) + {c['after_ready_s']:.2f} s ktlite after the last Ready + "
            f"{c['push_s']:.2f} s code push = {c['probe_s'] + ktlite:.2f} s; ktlite's part "
            f"<= {TARGET_TAIL_S:g} s: {met}{why}"
        )
    return lines


def table(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    head = (
        "step",
        "pods",
        "requests",
        "resp MB",
        "wall s",
        "client CPU s",
        "stand-in CPU s",
        "fake-clock s",
        "requests by kind",
    )
    lines = []
    for step in STEPS:
        for n in sorted(results):
            r = results[n][step]
            kinds = ", ".join(f"{k} {short(v)}" for k, v in r["by_kind"].items())
            lines.append(
                (
                    step,
                    str(n),
                    str(r["requests"]),
                    f"{r['resp_mb']:.2f}",
                    f"{r['wall_s']:.2f}",
                    f"{r['client_cpu_s']:.2f}",
                    f"{r['standin_cpu_s']:.2f}",
                    f"{r['fake_clock_s']:.1f}",
                    kinds,
                )
            )
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head) - 1)]
    fmt = "  ".join(f"{{:{'<' if i < 1 else '>'}{w}}}" for i, w in enumerate(widths)) + "  {}"
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths), "-" * 16)]
    out += [fmt.format(*row) for row in lines]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", default="8,64,256,1000", help="pod counts, comma-separated")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()
    sizes = sorted({int(p) for p in args.pods.split(",") if p.strip()})
    load = LoadLog()
    results: dict[int, dict[str, dict[str, Any]]] = {}
    started = time.perf_counter()
    run_one(2, LoadLog())  # warm-up, not reported: the first deploy builds the shipped source
    for n in sizes:
        results[n] = run_one(n, load)
        print(
            f"  {n} pods: {time.perf_counter() - started:.0f} s so far", file=sys.stderr, flush=True
        )
    print(
        f"ktlite Kubernetes backend against the stand-in API server (tests/kube_fake.py), "
        f"pods {', '.join(map(str, sizes))}; Python {platform.python_version()}, "
        f"{os.cpu_count()} CPU(s), {time.perf_counter() - started:.0f} s"
    )
    print(load.summary())
    print(
        "wall s, client CPU s, stand-in CPU s: real seconds (client CPU = this process's CPU "
        "less the stand-in's); fake-clock s: simulated seconds the step slept, no real time"
    )
    print(
        "code push, status, restart_failed, colocation push: the pod servers are stubs (GET "
        "/health, POST /deploy, GET /status, POST /restart_failed answered; no code runs)"
    )
    print()
    print(table(results))
    print()
    grown = {step: growth(results, step) for step in STEPS}
    print(
        "API requests against the pod count (extra requests per extra pod from the smallest "
        "to the largest; the counts at each size):"
    )
    for step in STEPS:
        g = grown[step]
        kinds = ", ".join(f"{k} +{v}/pod" for k, v in g["growing_kinds"].items())
        counts = " / ".join(str(results[n][step]["requests"]) for n in sizes)
        print(f"  {step:<24} {g['order']:<5} {g['per_pod']:>5.2f}/pod  ({counts})  {kinds}")
        for kind, cause in g["causes"].items():
            if cause:
                print(f"      {kind}: {cause}")
    print(
        "  a LIST pod answer carries every pod (resp MB grows with N; in pages of 500, so one "
        "request more per 500 pods); the readiness wait and teardown make one, then follow the "
        "pods with a WATCH, whose events grow with N too"
    )
    print()
    print("Targets (issue 26, item 3), at the largest size:")
    for step in STEPS:
        g = grown[step]
        if g["order"] == "n/a":
            print(f"  {step}: API requests O(1) in the pod count: n/a (one size run)")
            continue
        met = "met" if g["order"] == "O(1)" else "not met"
        causes = "; ".join(f"{k}: {c or 'see the table'}" for k, c in g["causes"].items())
        print(
            f"  {step}: API requests O(1) in the pod count: {met}"
            + (f" (cause: {causes})" if met == "not met" else "")
        )
    print(
        "  cold .to() bounded by the containers' start (ktlite's part after the last container "
        f"starts, past the simulated server start and probe, <= {TARGET_TAIL_S:g} s):"
    )
    for line in cold(results):
        print(line)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"pods": sizes, "results": results, "growth": grown, "load": load.steps})
        )


if __name__ == "__main__":
    main()
