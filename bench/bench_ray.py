"""Ray-cluster benchmark (issue 11): ktlite's distribute("ray") beside Ray's own start.

    python bench/bench_ray.py [--runs 3] [--json out.json]

Rows, each the median of ``--runs`` (cold rows) or of 30 calls (warm rows):

- cold, to the first result: a 1 + 2 node cluster, from nothing to a job's first result.
  ktlite: ``kt.fn(job).to(Compute(cpus=1).distribute("ray", workers=2))`` then one call
  (three pod servers start, each runs ``ray start``, the head waits until its GCS lists all
  three nodes, the code loads, the call runs). By hand: the same three ``ray start --block``
  commands with the same flags (head first, the workers once its GCS port answers, all
  three as soon as possible), then a driver process that runs the job. ``ray.init()``
  alone: a driver that starts a one-node cluster itself and runs the job.
- warm, a 100-task job: the same job (``ray.init(address="auto")``, 100 no-op tasks,
  ``ray.get``) called through ktlite on the formed cluster, against a driver already
  connected to the hand-started cluster running the job function in a loop.

``overhead`` is ktlite's time minus the peer's. The targets of issue 11: formation adds
under 0.5 s over bare ``ray start``; a warm call adds under 2 ms to the job itself. Each run
starts ktlite's cluster, the hand-started one and ``ray.init()`` alone in turn, the order
rotated between runs (``_rounds.py``); the load average is recorded before and after each run
and printed with the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

if __name__ == "__main__":  # not in the drivers, which import this module for job()
    _HOME = tempfile.mkdtemp(prefix="ktlite-bench-ray-")
    # before ktlite is imported: never share the tests' deployments
    os.environ["KTLITE_HOME"] = _HOME
    os.environ.pop("KTLITE_BACKEND", None)
# the peers run as Ray's defaults would without a ~/.ray/auth_token (ktlite's nodes use token
# auth with the deployment's token whatever this says)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from _rounds import LoadLog, print_overheads, run_rounds  # noqa: E402

import ktlite as kt  # noqa: E402
from ktlite.specs.spec import ray_ports  # noqa: E402

clock = time.perf_counter
TASKS = 100
WARM_CALLS = 30


def job(n: int = TASKS) -> int:
    import ray

    ray.init(address="auto", ignore_reinit_error=True)  # the hand-run driver calls it in a loop

    @ray.remote(num_cpus=0.01)
    def task(i: int) -> int:
        return i

    return sum(ray.get([task.remote(i) for i in range(n)]))


# ---- ktlite ----------------------------------------------------------------------------------


def ktlite_cold(i: int) -> tuple[float, Any]:
    t0 = clock()
    remote = kt.fn(job, name=f"bench-ray-{i}").to(
        kt.Compute(cpus=1, stream_logs=False).distribute("ray", workers=2)
    )
    assert remote() == sum(range(TASKS))
    return clock() - t0, remote


def ktlite_warm(remote: Any) -> list[float]:
    times = []
    for _ in range(WARM_CALLS):
        t0 = clock()
        remote()
        times.append(clock() - t0)
    return times


# ---- Ray by hand -----------------------------------------------------------------------------


def _free_base() -> int:
    for base in range(40000, 60000, 500):
        with socket.socket() as s:
            try:
                s.bind(("", base))
            except OSError:
                continue
        return base
    raise RuntimeError("no free port range")


def _args(base: int, ordinal: int, temp: str) -> list[str]:
    p = ray_ports(base, ordinal)
    head = ray_ports(base, 0)
    args = [
        "start",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp}",
        f"--node-manager-port={p['node_manager']}",
        f"--object-manager-port={p['object_manager']}",
        f"--runtime-env-agent-port={p['runtime_env_agent']}",
        f"--dashboard-agent-grpc-port={p['dashboard_agent_grpc']}",
        f"--dashboard-agent-listen-port={p['dashboard_agent_listen']}",
        f"--metrics-export-port={p['metrics_export']}",
        f"--min-worker-port={p['min_worker']}",
        f"--max-worker-port={p['max_worker']}",
        "--num-cpus=1" if ordinal == 0 else "--num-cpus=2",
        f"--object-store-memory={256 * 2**20}",
    ]
    if ordinal == 0:
        args += [
            "--head",
            f"--port={head['gcs']}",
            "--include-dashboard=false",
            f"--ray-client-server-port={p['client_server']}",
            f"--dashboard-port={p['dashboard']}",
        ]
    else:
        args.append(f"--address=127.0.0.1:{head['gcs']}")
    return args


def _ray(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"},
    )


def _until_started(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if b"Ray runtime started." in line:
            return
    raise RuntimeError("ray start ended before it started")


def _until_port(port: int, deadline: float) -> None:
    while clock() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port}")


DRIVER = """
import sys, time, json
sys.path.insert(0, {here!r})
from bench_ray import job
import ray
n = int(sys.argv[1])
ray.init(address={address!r})
out = [job() for _ in range(1)]
times = []
for _ in range(n):
    t0 = time.perf_counter(); job(); times.append(time.perf_counter() - t0)
print("TIMES " + json.dumps(times))
"""


def by_hand(warm_calls: int) -> tuple[float, list[float]]:
    """Three ray start commands and a driver: (seconds to the first result, warm job times)."""
    base = _free_base()
    temps = [tempfile.mkdtemp(prefix="ktray-b") for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    gcs = ray_ports(base, 0)["gcs"]
    try:
        t0 = clock()
        procs.append(_ray(_args(base, 0, temps[0])))
        _until_port(gcs, clock() + 60)  # as soon as the GCS answers, the workers go
        procs += [_ray(_args(base, k, temps[k])) for k in (1, 2)]
        for p in procs:
            _until_started(p)
        here = os.path.dirname(os.path.abspath(__file__))
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER.format(here=here, address=f"127.0.0.1:{gcs}"), "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        cold = clock() - t0
        if driver.returncode != 0:
            raise RuntimeError(driver.stderr[-2000:])
        warm: list[float] = []
        if warm_calls:
            driver = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    DRIVER.format(here=here, address=f"127.0.0.1:{gcs}"),
                    str(warm_calls),
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
            line = next((x for x in driver.stdout.splitlines() if x.startswith("TIMES ")), None)
            if line is None:
                raise RuntimeError(driver.stdout[-1000:] + driver.stderr[-2000:])
            warm = json.loads(line[len("TIMES ") :])
        return cold, warm
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)


INIT_ALONE = """
import sys, tempfile
sys.path.insert(0, {here!r})
import ray
ray.init(num_cpus=1, include_dashboard=False, object_store_memory=256 * 2**20,
         _temp_dir=tempfile.mkdtemp(prefix="ktray-i"))
from bench_ray import job
job()
ray.shutdown()
"""


def init_alone() -> float:
    here = os.path.dirname(os.path.abspath(__file__))
    t0 = clock()
    subprocess.run(
        [sys.executable, "-c", INIT_ALONE.format(here=here)],
        check=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"},
    )
    return clock() - t0


def _median(samples: list[float]) -> float | None:
    return statistics.median(samples) if samples else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    kt_cold: list[float] = []
    hand_cold: list[float] = []
    alone: list[float] = []
    kt_warm: list[float] = []
    hand_warm: list[float] = []
    load, notes = LoadLog(), []

    def ktlite(r: int) -> None:
        t, remote = ktlite_cold(r)
        try:
            kt_cold.append(t)
            if r == 0:
                kt_warm.extend(ktlite_warm(remote))
        finally:
            remote.teardown()

    def hand(r: int) -> None:
        t, warm = by_hand(WARM_CALLS if r == 0 else 0)
        hand_cold.append(t)
        hand_warm.extend(warm)

    def failed(name: str, e: BaseException) -> None:
        notes.append(f"{name} failed: {type(e).__name__}: {e}")

    try:  # each run: ktlite, the hand-started cluster and ray.init() alone, in turn (order rotated)
        run_rounds(
            "cold cluster",
            {
                "ktlite": ktlite,
                "by hand": hand,
                "ray.init() alone": lambda r: alone.append(init_alone()),
            },
            args.runs,
            load,
            failed,
        )
    finally:
        shutil.rmtree(_HOME, ignore_errors=True)
    rows = [
        (
            "cold 1+2 node cluster to the first result",
            _median(kt_cold),
            _median(hand_cold),
            "ray start x3 + driver",
        ),
        ("cold, against ray.init() alone (1 node)", _median(kt_cold), _median(alone), "ray.init()"),
        (
            f"warm call, {TASKS}-task job (p50 of {WARM_CALLS})",
            _median(kt_warm),
            _median(hand_warm),
            "connected driver",
        ),
    ]
    print_overheads(
        rows,
        f"ktlite cold {[round(t, 2) for t in kt_cold]}, by hand {[round(t, 2) for t in hand_cold]}, "
        f"ray.init() {[round(t, 2) for t in alone]}",
        load,
        notes,
        args.json,
    )


if __name__ == "__main__":
    main()
