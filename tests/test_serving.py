"""Autoscaled serving (``Compute.autoscale``): the config and its rule (pure), then real
local replicas: routing to one replica, growing and shrinking with load, scale to zero and
back, a replica lost mid-call, code rollout to replicas started later, status and the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt
from ktlite.backends.processes import pid_alive
from ktlite.backends.registry import get_backend
from ktlite.specs.autoscaling import AutoscaleConfig, Scaler, from_kwargs, seconds
from ktlite_wire.launch import Launch, decode_deploy


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# ---- the config ------------------------------------------------------------------------------


def test_autoscale_takes_kubetorchs_names_and_knative_annotations() -> None:
    c = kt.Compute(cpus=1).autoscale(
        min_scale=0,
        max_scale=8,
        concurrency=4,
        target=3,
        window="30s",
        target_utilization=50,
        initial_scale=2,
        progress_deadline="10m",
        panic_window_percentage=20,
    )
    a = c.autoscaling
    assert (a.min, a.max_scale, a.initial, a.concurrency) == (0, 8, 2, 4)
    assert a.target_per_replica == 1.5  # target 3 at 50 %
    ann = a.annotations()
    assert ann["autoscaling.knative.dev/min-scale"] == "0"
    assert ann["autoscaling.knative.dev/max-scale"] == "8"
    assert ann["autoscaling.knative.dev/target"] == "3"
    assert ann["autoscaling.knative.dev/window"] == "30s"
    assert ann["autoscaling.knative.dev/panic-window-percentage"] == "20"
    # Kubetorch's defaults for ML workloads
    assert ann["autoscaling.knative.dev/scale-down-delay"] == "1m"
    assert ann["autoscaling.knative.dev/scale-to-zero-pod-retention-period"] == "10m"
    assert from_kwargs({"min_replicas": 1, "max_replicas": 2}).max_scale == 2
    # Kubetorch's examples: @kt.autoscale(initial_replicas=1, min_replicas=0, max_replicas=10, ...);
    # initial_replicas was taken for a Knative annotation of that name, which nothing reads
    named = from_kwargs({"initial_replicas": 2, "min_replicas": 0, "max_replicas": 10})
    assert (named.initial, named.min, named.max_scale, named.extra) == (2, 0, 10, {})
    assert named.annotations()["autoscaling.knative.dev/initial-scale"] == "2"
    assert not any("replicas" in k for k in named.annotations())
    with pytest.raises(kt.ConfigError, match="initial_scale= or initial_replicas="):
        from_kwargs({"initial_replicas": 2, "initial_scale": 2})
    assert seconds("1m5s", "x") == 65 and seconds(2.5, "x") == 2.5
    # concurrency is the target when none is given; Knative's 100 otherwise
    assert AutoscaleConfig(concurrency=2).target_per_replica == pytest.approx(1.4)
    assert AutoscaleConfig().target_per_replica == 70


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"min_scale": 3, "max_scale": 2}, "min_scale cannot be above max_scale"),
        ({"max_scale": 0}, "max_scale=0"),
        ({"concurrency": 0}, "concurrency=0"),
        ({"metric": "gpu"}, "allowed: 'concurrency'"),
        ({"window": "ten seconds"}, "duration"),
        ({"scale_down_delay": "-1s"}, "duration"),
        ({"target_utilization": 150}, "percentage"),
        ({"autoscaler_class": "mine"}, "autoscaler_class"),
        (
            {"metric": "cpu", "autoscaler_class": "kpa.autoscaling.knative.dev"},
            "needs autoscaler_class",
        ),
        ({"initial_scale": 9, "max_scale": 4}, "initial_scale=9"),
        ({"min_scale": True}, "whole number"),
    ],
)
def test_bad_autoscale_options_fail_before_anything_is_deployed(
    kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(kt.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        kt.Compute().autoscale(**kwargs)


def test_autoscale_and_distribute_exclude_each_other_both_ways() -> None:
    with pytest.raises(kt.ConfigError, match=r"both \.distribute\(\) and \.autoscale\(\)"):
        kt.Compute().distribute("pytorch", workers=2).autoscale(max_scale=2)
    with pytest.raises(kt.ConfigError, match=r"both \.autoscale\(\) and \.distribute\(\)"):
        kt.Compute().autoscale(max_scale=2).distribute("pytorch", workers=2)
    with pytest.raises(kt.ConfigError, match="replicas"):
        kt.Compute(replicas=2).autoscale(max_scale=2)
    with pytest.raises(kt.ConfigError, match="ssh"):
        kt.Compute(hosts=["a", "b"]).autoscale(max_scale=2)
    with pytest.raises(kt.ConfigError, match="@kt.autoscale|distribute"):
        kt.autoscale(max_scale=2)(kt.distribute("spmd", workers=2)(lambda: None))


# ---- the rule --------------------------------------------------------------------------------


def test_scaler_grows_with_load_at_once_and_shrinks_only_after_the_delay() -> None:
    s = Scaler(
        AutoscaleConfig(
            min_scale=1, max_scale=4, concurrency=2, window="10s", scale_down_delay="5s"
        ),
        max_default=8,
    )
    for t in range(6):  # one call at a time: one replica is enough
        assert s.decide(float(t), 1.0, 1, float(t)).desired == 1
    d = s.decide(6.0, 16.0, 1, 6.0)  # then 16 calls in flight and waiting: a burst
    assert d.desired == 4 and "panic" in d.reason
    for t in range(7, 14):
        d = s.decide(float(t), 16.0, 4, float(t))
        assert d.desired == 4
    steps = []
    for t in range(14, 40):  # the load is gone
        d = s.decide(float(t), 0.0, d.desired, 13.0)
        steps.append(d)
    waited = [x.at for x in steps if "waiting scale_down_delay" in x.reason]
    first_drop = next(x.at for x in steps if x.desired < 4)
    assert waited and first_drop - waited[0] >= 5  # fewer were wanted for the whole delay first
    assert d.desired == 1  # min_scale, after the window and the delay


def test_scaler_scales_to_zero_only_after_the_retention_period() -> None:
    s = Scaler(
        AutoscaleConfig(
            min_scale=0,
            max_scale=2,
            window="2s",
            scale_down_delay="1s",
            scale_to_zero_pod_retention_period="5s",
        ),
        max_default=8,
    )
    d = s.decide(0.0, 1.0, 0, 0.0)
    assert d.desired == 1  # a call with nothing running: a cold start
    current = 1
    for t in range(1, 5):
        d = s.decide(float(t), 0.0, current, 0.0)
        assert d.desired == 1, d.reason
    d = s.decide(6.0, 0.0, current, 0.0)
    assert d.desired == 0 and "scaled to zero" in d.reason


def test_scaler_keeps_the_initial_replicas_for_the_scale_down_delay() -> None:
    # initial_scale=2 with no calls: both replicas stay scale_down_delay, then one goes (it
    # once went at the first tick, so initial_scale above 1 lasted a quarter of a second)
    s = Scaler(
        AutoscaleConfig(
            min_scale=0,
            max_scale=3,
            initial_scale=2,
            scale_down_delay="5s",
            scale_to_zero_pod_retention_period="60s",
        ),
        max_default=8,
    )
    s.started(0.0, 2)
    for t in (0.25, 1.0, 4.9):
        d = s.decide(t, 0.0, 2, None)
        assert d.desired == 2, (t, d.reason)
    assert s.decide(5.5, 0.0, 2, None).desired < 2


# ---- real local replicas ---------------------------------------------------------------------


class Model:
    def __init__(self, scale: int = 1) -> None:
        self.scale = scale

    def predict(self, x: int, sleep: float = 0.0) -> tuple[int, int]:
        import os
        import time

        time.sleep(sleep)
        return os.getpid(), x * self.scale

    def size(self, blob: bytes) -> int:
        return len(blob)

    def env(self) -> dict[str, str]:
        import os

        return {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "KTLITE_POD_ORDINAL")}


def _replicas(remote: Any) -> int:
    return len(remote.status()["replicas"])


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_load_grows_to_max_scale_and_shrinks_back_after_the_delay() -> None:
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=1, max_scale=4, concurrency=2, window="1s", scale_down_delay="1s"
    )
    remote = kt.cls(Model, name=_name("grow")).to(compute, init_args={"scale": 3})
    try:
        assert remote.predict(2)[1] == 6  # one call, one replica, one value
        assert remote.size(b"x" * 3_000_000) == 3_000_000  # too big to inline: a shared-memory file
        env = remote.env()
        assert env == {"RANK": "0", "WORLD_SIZE": "1", "KTLITE_POD_ORDINAL": "0"}
        assert _replicas(remote) == 1
        futures = [remote.predict.submit(i, sleep=1.5) for i in range(16)]
        _wait(lambda: _replicas(remote) == 4, 30, "4 replicas under 16 calls")
        results = [f.result(timeout=60) for f in futures]
        assert [v for _, v in results] == [3 * i for i in range(16)]
        assert len({pid for pid, _ in results}) >= 2  # the calls were spread
        status = remote.status()
        assert status["autoscaler"]["max"] == 4 and status["autoscaler"]["last_decision"]["reason"]
        assert max(r["served"] for r in status["replicas"]) <= 16
        _wait(lambda: _replicas(remote) == 1, 30, "back to min_scale=1 after the load")
        assert remote.predict(5)[1] == 15
    finally:
        remote.teardown()


def test_scale_to_zero_and_back() -> None:
    name = _name("zero")
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=0,
        max_scale=2,
        window="1s",
        scale_down_delay="0.5s",
        scale_to_zero_pod_retention_period="1s",
    )
    remote = kt.cls(Model, name=name).to(compute)
    try:
        first = remote.predict(1)
        _wait(lambda: _replicas(remote) == 0, 30, "scale to zero")
        assert [r for r in get_backend("local").list() if r["name"] == name][0]["pods"] == 0
        status = remote.status()
        assert "zero" in status["autoscaler"]["last_decision"]["reason"]
        started = time.monotonic()
        again = remote.predict(2)  # a cold start: a replica starts and loads the code first
        assert again[1] == 2 and again[0] != first[0]
        assert time.monotonic() - started < 30
    finally:
        remote.teardown()


def test_a_replica_killed_mid_call_fails_that_call_only() -> None:
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=2, max_scale=2, concurrency=1, window="1s", scale_down_delay="1s"
    )
    remote = kt.cls(Model, name=_name("kill")).to(compute)
    try:
        _wait(lambda: _replicas(remote) == 2, 30, "2 replicas")
        slow = [remote.predict.submit(i, sleep=4.0) for i in range(2)]
        _wait(
            lambda: sum(r["inflight"] for r in remote.status()["replicas"]) == 2,
            20,
            "2 calls running",
        )
        victim = remote.status()["replicas"][0]["pod"]
        os.killpg(victim["server_pid"], signal.SIGKILL)
        outcomes = []
        for f in slow:
            try:
                outcomes.append(("ok", f.result(timeout=30)))
            except kt.KtliteError as e:
                outcomes.append(("error", e))
        errors = [o for kind, o in outcomes if kind == "error"]
        assert len(errors) == 1, outcomes
        assert victim["pod"] in str(errors[0]) and "not sent again" in str(errors[0])
        assert [v for kind, v in outcomes if kind == "ok"][0][1] in (0, 1)
        assert remote.predict(7)[1] == 7  # the next call goes elsewhere
        _wait(lambda: _replicas(remote) == 2, 30, "the lost replica replaced")
    finally:
        remote.teardown()


def v1() -> str:
    return "v1"


def v2(sleep: float = 0.0) -> str:
    import time

    time.sleep(sleep)
    return "v2"


def launch_file() -> str:
    import os

    return os.environ.get("KTLITE_LAUNCH_FILE", "")


def test_a_local_replica_boots_from_a_launch_file_named_for_the_message_it_holds() -> None:
    # the file holds the Launch message as ktlite_wire encodes it (a JSON header, the code in
    # buffers), no pickle: its name says so, and it decodes as that message
    compute = kt.Compute(cpus=0.5).autoscale(min_scale=1, max_scale=1)
    remote = kt.fn(launch_file, name=_name("lfile")).to(compute)
    try:
        path = Path(remote())
        assert path.name == "launch.msg", path
        assert not path.with_name("launch.pkl").exists()
        launch = decode_deploy(path.read_bytes())
        assert isinstance(launch, Launch) and launch.launch_id == remote.deployment.launch_id
    finally:
        remote.teardown()


def test_a_redeploy_reaches_every_replica_and_replicas_started_later() -> None:
    name = _name("roll")
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=2, max_scale=3, concurrency=1, window="1s", scale_down_delay="30s"
    )
    first = kt.fn(v1, name=name).to(compute)
    second = None
    try:
        assert first() == "v1"
        second = kt.fn(v2, name=name).to(compute)
        assert {second() for _ in range(6)} == {"v2"}  # never old code once .to() returned
        futures = [second.submit(sleep=1.0) for _ in range(6)]  # grows to 3: the new one loads v2
        _wait(lambda: _replicas(second) == 3, 30, "a third replica")
        assert {f.result(timeout=60) for f in futures} == {"v2"}
        assert {r["launch_id"] for r in second.status()["replicas"]} == {
            second.deployment.launch_id
        }
        with pytest.raises(kt.NotDeployedError, match="redeployed"):
            for _ in range(20):  # the first handle notices the new launch and says so
                first()
                time.sleep(0.3)
    finally:
        (second or first).teardown()


def test_status_list_and_reattach_by_name(tmp_path: Any) -> None:
    name = _name("cli")
    script = tmp_path / "serve_it.py"
    script.write_text(
        "import ktlite as kt\n\n"
        f"@kt.compute(cpus=0.5, name={name!r})\n"
        "@kt.autoscale(min_scale=1, max_scale=2, concurrency=2, window='1s', scale_down_delay='1s')\n"
        "def triple(x):\n"
        "    return 3 * x\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cli = [sys.executable, "-m", "ktlite.commands.cli"]
    try:
        out = subprocess.run(
            [*cli, "deploy", f"{script}:triple"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        remote = kt.fn(name=name)
        assert remote(4) == 12  # one value from one replica
        listed = subprocess.run([*cli, "list"], capture_output=True, text=True, env=env, timeout=60)
        row = [line for line in listed.stdout.splitlines() if line.startswith(name)]
        assert row and "autoscaled" in row[0], listed.stdout
        shown = subprocess.run(
            [*cli, "status", name], capture_output=True, text=True, env=env, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        assert "autoscaled, 1 replica(s) running (1..2)" in shown.stdout
        assert "last decision" in shown.stdout and f"replica {name}-0" in shown.stdout
        # one process scales (the deployment's own autoscaler process, or this one if it took the
        # lead first): scaling_status() is that one's last decision
        said = remote.scaling_status()
        assert said["autoscaler"].startswith("ktlite") and said["last_decision"]["reason"]
        assert said.get("alive", True) is True  # another process's record says whether it lives
        assert (said["current"], said["min"], said["max"]) == (1, 1, 2)
        with pytest.raises(kt.ConfigError, match="one replica"):
            remote(4, workers=[0])
    finally:
        subprocess.run([*cli, "teardown", name], capture_output=True, env=env, timeout=60)


def test_scaling_status_of_the_handle_is_what_ktlites_autoscaler_says() -> None:
    """docs/kubernetes.md and docs/serving.md name ``scaling_status()`` on the handle: on the
    local backend it is ktlite's own autoscaler (in this process)."""
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=1, max_scale=2, concurrency=2, window="1s", scale_down_delay="1s"
    )
    remote = kt.cls(Model, name=_name("said")).to(compute)
    plain = kt.fn(v1, name=_name("plain")).to(kt.Compute(cpus=0.5))
    try:
        assert remote.predict(2)[1] == 2
        _wait(lambda: remote.scaling_status()["last_decision"] is not None, 30, "a first decision")
        said = remote.scaling_status()
        assert said["autoscaler"] == "ktlite (in this process)"
        assert (said["current"], said["desired"], said["min"], said["max"]) == (1, 1, 1, 2)
        assert said["metric"] == "concurrency" and said["target_per_replica"] == pytest.approx(1.4)
        assert said["last_decision"]["reason"] and said["error"] is None
        with pytest.raises(kt.ConfigError, match="is not an autoscaled service: scaling_status"):
            plain.scaling_status()
    finally:
        remote.teardown()
        plain.teardown()


def test_replicas_stopped_by_a_scale_down_leave_the_state_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process reading a deployment's state while its replicas stop must never find
    only dead replicas listed: it takes such a deployment for gone and deletes its directory,
    spec and code with it (a detached deployment scaling to zero then waited for ever for a
    replica that could not start: ``test_a_detached_deployment_scales_to_zero...`` hung so on
    a busy machine)."""
    import secrets
    from dataclasses import replace

    from ktlite.specs.deployment_spec import DeploymentSpec

    backend = get_backend("local")
    spec = DeploymentSpec(
        _name("order"),
        kt.Compute(cpus=0.1).autoscale(min_scale=0, max_scale=2).pod_spec(),
        detached=True,
    )
    token = secrets.token_urlsafe(16)
    backend.apply(replace(spec, replicas=2), token)
    stopped: list[tuple[int, bool]] = []
    real = backend._stop_pods

    def stop_pods(pods: list[dict[str, Any]], timeout: float) -> None:
        listed = {p["pid"] for p in (backend._read(spec.name) or {}).get("pods", [])}
        stopped.extend((p["pid"], p["pid"] in listed) for p in pods)
        real(pods, timeout)

    try:
        with monkeypatch.context() as m:
            m.setattr(backend, "_stop_pods", stop_pods)
            applied = backend.apply(replace(spec, replicas=1), token)
        assert [ep.ordinal for ep in applied.endpoints] == [0]
        assert len(stopped) == 1 and stopped[0][1] is False, (
            stopped
        )  # out of the state, then stopped
        assert not pid_alive(stopped[0][0])
    finally:
        backend.teardown(spec.name)


def test_the_ssh_backend_refuses_autoscale_before_deploying() -> None:
    with pytest.raises(kt.ConfigError, match="ssh"):
        kt.fn(v1).to(kt.Compute(backend="ssh").autoscale(max_scale=2))


def test_a_detached_deployment_scales_to_zero_with_no_client_and_back(tmp_path: Any) -> None:
    """Its autoscaler is a process of its own: the deploying process exits, the replicas still
    go to zero after the retention period, and a later caller (attached by name) starts one."""
    name = _name("detached")
    script = tmp_path / "deploy_it.py"
    script.write_text(
        "import sys, ktlite as kt\n"
        "def square(x):\n"
        "    return x * x\n"
        "compute = kt.Compute(cpus=0.5).autoscale(min_scale=0, max_scale=2, window='1s',\n"
        "    scale_down_delay='0.5s', scale_to_zero_pod_retention_period='2s')\n"
        f"remote = kt.fn(square, name={name!r}).to(compute, detached=True)\n"
        "assert remote(3) == 9\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    backend = get_backend("local")

    def pods() -> int:
        rows = [r for r in backend.list() if r["name"] == name]
        return rows[0]["pods"] if rows else -1

    try:
        _wait(lambda: pods() == 0, 30, "the supervisor scaling the detached deployment to zero")
        remote = kt.fn(name=name)
        assert remote(4) == 16  # a cold start from a process that only attached
        assert pods() == 1
        supervisor = int((backend._dir(name) / "supervisor.pid").read_text())
        assert pid_alive(supervisor)
    finally:
        backend.teardown(name)
    assert not pid_alive(supervisor)  # teardown stops the autoscaler process first
    assert backend.scaling_status(name) is None and backend.lookup(name) is None


def test_rps_metric_scales_on_calls_per_second() -> None:
    compute = kt.Compute(cpus=0.5).autoscale(
        min_scale=1, max_scale=2, metric="rps", target=5, window="1s", scale_down_delay="60s"
    )
    remote = kt.cls(Model, name=_name("rps")).to(compute)
    try:
        deadline = time.monotonic() + 30
        while _replicas(remote) < 2 and time.monotonic() < deadline:
            remote.predict(1)  # one at a time, far more than 5 per second
        status = remote.status()
        assert len(status["replicas"]) == 2, status["autoscaler"]
        assert (
            status["autoscaler"]["metric"] == "rps"
            and "rps" in status["autoscaler"]["last_decision"]["reason"]
        )
    finally:
        remote.teardown()


def test_kubetorchs_decorated_autoscaled_class_exits_cleanly_without_teardown(
    tmp_path: Any,
) -> None:
    """Kubetorch's serving example as a script: initial_replicas is the replicas at deploy,
    and the script ends without teardown: nothing but its own output at interpreter exit
    (its scaling thread once sent a request on the closed HTTP client and printed
    "scaling: RuntimeError: Cannot send a request, as the client has been closed")."""
    script = tmp_path / "serve_gnn.py"
    script.write_text(
        "import ktlite as kt\n\n"
        f"@kt.compute(cpus='0.5', name={_name('gnn')!r})\n"
        "@kt.autoscale(initial_replicas=2, min_replicas=0, max_replicas=3, concurrency=10)\n"
        "class GNNInference:\n"
        "    def predict(self, batch):\n"
        "        return [x * 2 for x in batch]\n\n"
        "if __name__ == '__main__':\n"
        "    print('PREDICTED', GNNInference.predict([1, 2]))\n"
        "    print('REPLICAS', len(GNNInference.remote().status()['replicas']))\n"
    )
    home = tmp_path / "home"
    env = {**os.environ, "KTLITE_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["PREDICTED [2, 4]", "REPLICAS 2"], done.stdout + done.stderr
    assert "client has been closed" not in done.stderr and "scaling:" not in done.stderr, (
        done.stderr
    )
    listed = subprocess.run(
        [sys.executable, "-m", "ktlite.commands.cli", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert listed.stdout.strip() == "no deployments", (
        listed.stdout
    )  # torn down at exit all the same
