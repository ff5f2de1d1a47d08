"""distribute("ray") with real Ray: one head and two worker nodes formed by the local
pods' servers (three ``ray start`` process trees on this machine).

Marked ``ray``: not in the default run (it costs about a minute); ``.ci/run`` runs it with
``pytest -m ray``. One cluster serves the module; the teardown test ends it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import ktlite as kt
from ktlite_server.ray_members import FRESH_S

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def run_ray_job(n: int = 100) -> list[tuple[int, str]]:
    """The seed's job: ray.init(address="auto") and 100 tasks fanned out."""
    import ray

    ray.init(address="auto")

    @ray.remote(num_cpus=1)
    def task(i: int) -> tuple[int, str]:
        import time

        time.sleep(0.02)  # long enough that one node cannot take every task
        return i, ray.get_runtime_context().get_node_id()

    return ray.get([task.remote(i) for i in range(n)])


def failing_job() -> None:
    import ray

    ray.init()

    @ray.remote
    def bad(x: int) -> None:
        raise KeyError(f"no shard {x}")

    ray.get(bad.remote(7))


def cluster_size() -> dict[str, int]:
    import ray

    ray.init()
    return {
        "nodes": len([n for n in ray.nodes() if n["Alive"]]),
        "cpus": int(ray.cluster_resources().get("CPU", 0)),
    }


COMPUTE = kt.Compute(cpus=1).distribute("ray", workers=2, worker_node_options={"cpus": 2})


def deploy(fn):
    """Code onto the module's cluster: only the code changes, the Ray nodes stay."""
    return kt.fn(fn, name="ray-seed").to(COMPUTE)


@pytest.fixture(scope="module")
def cluster():
    remote = deploy(run_ray_job)
    yield remote
    remote.teardown()


def _engines(remote) -> list[dict]:
    return [pod["engine"] for pod in remote.status()]


def test_seed_job_spreads_over_the_nodes(cluster) -> None:
    results = cluster()  # one value from the head, not a list per pod
    assert sorted(i for i, _ in results) == list(range(100))
    assert len({node for _, node in results}) >= 2


def test_nodes_sized_head_and_workers(cluster) -> None:
    assert deploy(cluster_size)() == {"nodes": 3, "cpus": 1 + 2 + 2}


def test_nodes_wait_for_startup_as_long_as_the_launch_timeout(cluster) -> None:
    # Ray's own startup waits (10-30 s) gave up on a busy machine while ktlite still waited
    want = str(int(COMPUTE.launch_timeout))
    for engine in _engines(cluster):
        env = dict(
            kv.split("=", 1)
            for kv in Path(f"/proc/{engine['pid']}/environ").read_text().split("\0")
            if "=" in kv
        )
        assert env["RAY_raylet_start_wait_time_s"] == env["RAY_gcs_server_port_wait_time_s"] == want
        assert env["RAY_agent_register_timeout_ms"] == want + "000"


def test_code_only_redeploy_keeps_the_cluster(cluster) -> None:
    before = _engines(cluster)
    assert (
        all(e["alive"] for e in before) and before[0]["lost"] == [] and len(before[0]["nodes"]) == 3
    )

    def run_ray_job(n: int = 10) -> int:  # noqa: F811 - new code under the same name
        import ray

        ray.init(address="auto")
        return sum(ray.get([ray.remote(lambda i: i * i).remote(i) for i in range(n)]))

    again = deploy(run_ray_job)
    assert again() == sum(i * i for i in range(10))
    after = _engines(again)
    assert [(e["pid"], e["started_at"]) for e in after] == [
        (e["pid"], e["started_at"]) for e in before
    ]


def test_a_task_error_keeps_its_type(cluster) -> None:
    remote = deploy(failing_job)
    with pytest.raises(KeyError, match="no shard 7") as info:
        remote()
    assert "RayTaskError" not in type(info.value).__name__


def test_a_lost_worker_node_shows_in_status(cluster) -> None:
    pid = _engines(cluster)[2]["pid"]
    os.killpg(pid, signal.SIGKILL)  # the node's whole process tree, as a dead host would
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        head = _engines(cluster)[0]
        if head.get("lost"):
            break
        time.sleep(1)
    assert head["lost"] == ["ray-seed-2"], head
    pods = cluster.status()
    assert pods[2]["engine"]["alive"] is False


def test_teardown_leaves_no_ray_behind(cluster) -> None:
    engines = _engines(cluster)
    pids = [e["pid"] for e in engines if e["pid"]]
    dirs = [Path(e["temp_dir"]) for e in engines]
    assert all(d.is_dir() for d in dirs)
    cluster.teardown()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_group_alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if _group_alive(p)]
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_ray(p, dirs)]
    assert not leftovers, [(p.name, (p / "cmdline").read_bytes()[:120]) for p in leftovers]
    assert not [d for d in dirs if d.exists()]  # Ray's session dirs (logs, sockets) are gone


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _is_ray(proc: Path, dirs: list[Path]) -> bool:
    """A process of one of these Ray nodes (named by its temp dir on its command line)."""
    try:
        cmd = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return any(str(d).encode() in cmd for d in dirs)


def test_ray_start_failure_fails_to_with_the_pods_output(tmp_path: Path) -> None:
    # a `ray` package that cannot start shadows the real one on the pods
    fake = tmp_path / "ray" / "scripts"
    fake.mkdir(parents=True)
    (tmp_path / "ray" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "scripts.py").write_text(
        "raise SystemExit('this ray cannot start: broken on purpose')\n"
    )
    compute = kt.Compute(env={"PYTHONPATH": str(tmp_path)}).distribute("ray", workers=1)
    with pytest.raises(kt.DeployError) as info:
        kt.fn(run_ray_job, name="ray-broken").to(compute)
    text = str(info.value)
    assert (
        "ray start exited with code 1" in text
        and "broken on purpose" in text
        and "ray-broken-0" in text
    )
    kt.fn(run_ray_job, name="ray-broken").to(kt.Compute()).teardown()


def _free_master_port(compute: kt.Compute) -> int:
    """A MASTER_PORT whose whole span of ports is free here now."""
    from ktlite.specs.spec import port_free

    span = compute.distributed.port_span
    for base in range(31000, 60000, 1009):
        if all(port_free(p) for p in range(base, base + span)):
            return base
    raise AssertionError("no free span of ports for the test's deployment")


def test_a_worker_whose_ray_start_fails_is_reported_with_its_own_error() -> None:
    import socket

    from ktlite.backends.local import LocalBackend
    from ktlite.specs.spec import ray_ports

    port = _free_master_port(kt.Compute().distribute("ray", workers=1))
    compute = kt.Compute(launch_timeout=120).distribute("ray", workers=1, port=port)
    held = ray_ports(port, 1)["node_manager"]  # the worker's raylet cannot bind it
    try:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", held))
            sock.listen()
            with pytest.raises(kt.DeployError) as info:
                kt.fn(run_ray_job, name="ray-held").to(compute)
    finally:
        LocalBackend.shared().teardown("ray-held")
    text = str(info.value)
    # the worker's own error: what its raylet logged, not the head's timeout
    assert (
        "rank 1 on pod ray-held-1" in text and "raylet.out" in text and f"port is {held}" in text
    ), text
    assert "joined the head" not in text, text
    # and the head stopped waiting for it
    assert (
        "rank 0 on pod ray-held-0: the Ray cluster at" in text
        and "- pod ray-held-1: ray start failed" in text
    )


def test_a_head_alone_forms_and_runs() -> None:
    remote = kt.fn(cluster_size, name="ray-alone").to(
        kt.Compute(cpus=1).distribute("ray", workers=0)
    )
    try:
        assert remote() == {"nodes": 1, "cpus": 1}
        head = remote.status()[0]["engine"]
        assert head["lost"] == [] and [n["alive"] for n in head["nodes"]] == [True]
    finally:
        remote.teardown()


SLOW_PROBE = """\
import time
try:
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
except OSError:
    cmdline = b""
if b"ktlite_server.ray_probe" in cmdline:
    time.sleep(8)  # Ray's import in the probe, on a busy machine
"""


def test_status_answers_while_the_gcs_probe_is_slow(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SLOW_PROBE)
    compute = kt.Compute(cpus=1, env={"PYTHONPATH": str(tmp_path)}).distribute("ray", workers=0)
    remote = kt.fn(cluster_size, name="ray-slow-probe").to(compute)
    try:
        time.sleep(FRESH_S + 0.5)  # the list is no longer fresh: status asks the GCS again, slowly
        head = remote.status()[0]["engine"]  # the client gives /status 5 s
        assert head["alive"] and head["probe"] == "pending" and head["lost"] == [], head
        assert [n["alive"] for n in head["nodes"]] == [True]  # the last list the GCS gave
        first = head["nodes_as_of"]
        deadline = time.monotonic() + 120
        while head["nodes_as_of"] == first and time.monotonic() < deadline:
            time.sleep(1)
            head = remote.status()[0]["engine"]
        assert head["nodes_as_of"] > first and head["lost"] == []  # the slow probe's answer came
    finally:
        remote.teardown()
