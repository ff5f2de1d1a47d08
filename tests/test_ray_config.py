"""distribute("ray") without running Ray: bad input fails before anything is deployed, the
ports and ``ray start`` arguments of every node, the manifests of head and worker pods, and
how the head tells which nodes joined. The real cluster is in test_ray.py."""

from __future__ import annotations

import asyncio

import pytest

import ktlite as kt
from ktlite.backends import kube_manifests as km
from ktlite.backends.local import LocalBackend
from ktlite.modes import engines
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.spec import ray_ports
from ktlite_server import raynode


def job() -> int:
    return 1


def test_workers_counts_the_worker_nodes_besides_the_head() -> None:
    c = kt.Compute(cpus=2).distribute("ray", workers=4)
    assert c.distributed.workers == 5 and c.distributed.world_size == 5 and c.distributed.engine
    assert kt.Compute().distribute("ray").distributed.workers == 2  # one worker node by default
    assert kt.Compute().distribute("ray", workers=0).distributed.workers == 1  # a head alone


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"workers": 2, "num_proc": 2}, "num_proc has no meaning"),
        ({"workers": -1}, "worker nodes besides the head"),
        ({"workers": 2, "worker_node_options": {"cpu": 2}}, "unknown or head-only field.*'cpu'"),
        ({"workers": 2, "worker_node_options": {"image": "x"}}, "head-only"),
        ({"workers": 2, "worker_node_options": {"memory": "lots"}}, "memory='lots'"),
        ({"workers": 2, "worker_node_options": ["cpus", 2]}, "must be a dict"),
        ({"workers": 2, "bogus": 1}, "unknown option.*bogus"),
    ],
)
def test_bad_ray_options_are_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(kt.ConfigError, match=match):
        kt.Compute().distribute("ray", **kwargs)


def test_worker_node_options_only_for_ray() -> None:
    with pytest.raises(kt.ConfigError, match="only framework='ray'"):
        kt.Compute().distribute("pytorch", workers=2, worker_node_options={"cpus": 2})
    with pytest.raises(kt.ConfigError, match="needs distribute\\('ray'"):
        kt.Compute(worker_node_options={"cpus": 2})
    # switching a Ray compute to another framework drops the worker sizes
    c = (
        kt.Compute()
        .distribute("ray", workers=1, worker_node_options={"cpus": 2})
        .distribute("pytorch", workers=2)
    )
    assert c.worker_node_options is None


def test_decorator_checks_ray_options_at_decoration() -> None:
    with pytest.raises(kt.ConfigError, match="unknown or head-only"):
        kt.distribute("ray", workers=2, worker_node_options={"gpu": 1})
    marked = kt.distribute("ray", workers=2, worker_node_options={"cpus": "2"})(job)
    assert marked.compute.pod_compute(1).cpus == "2" and marked.compute.distributed.workers == 3


def test_no_ray_on_the_client_fails_before_any_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "client_ray_version", lambda: None)
    with pytest.raises(kt.ConfigError, match="needs Ray on this machine.*ktlite\\[ray\\]"):
        kt.fn(job, name="ray-no-client").to(kt.Compute().distribute("ray", workers=1))
    assert LocalBackend.shared().lookup("ray-no-client") is None


def test_per_rank_and_workers_do_not_apply_to_a_ray_call() -> None:
    from ktlite.modes.deploy import CallOptions, Deployment, mode_for
    from ktlite.modes.fanout import HeadOnly

    spec = DeploymentSpec(name="r", pod=kt.Compute().distribute("ray", workers=2).pod_spec())
    dep = Deployment.__new__(Deployment)
    dep.spec = spec
    mode = mode_for(spec)(dep)  # the strategy chosen at deploy
    assert isinstance(mode, HeadOnly) and mode.single
    for options, per_rank in (
        (CallOptions(workers=[1]), None),
        (CallOptions(ranks=[2]), None),
        (CallOptions(), {"x": 1}),
    ):
        with pytest.raises(kt.ConfigError, match="Ray cluster: a call runs once, on the head"):
            mode.head_options(options, per_rank)
    assert mode.head_options(CallOptions(timeout=5), None) == CallOptions(timeout=5, ranks=[0])


def test_ray_ports_are_distinct_per_node_and_inside_the_span() -> None:
    config = kt.Compute().distribute("ray", workers=3).distributed
    seen: set[int] = set()
    for ordinal in range(config.workers):
        p = ray_ports(20000, ordinal)
        ports = {v for k, v in p.items() if k not in ("min_worker", "max_worker")}
        ports |= set(range(p["min_worker"], p["max_worker"] + 1))
        assert not ports & seen and min(ports) >= 20032 and max(ports) < 20000 + config.port_span
        seen |= ports
    with pytest.raises(kt.ConfigError, match="no room for the Ray nodes"):
        ray_ports(65500, 0)


def _spec(**options) -> DeploymentSpec:
    c = kt.Compute(cpus="4", memory="16Gi").distribute("ray", workers=2, **options)
    return DeploymentSpec(name="rayjob", pod=c.pod_spec())


def test_node_settings_head_and_workers() -> None:
    spec = _spec(worker_node_options={"cpus": "2.5", "memory": "8Gi", "gpus": 1})
    ips, names = ["10.0.0.5", "10.0.0.6", "10.0.0.7"], ["rayjob-0", "rayjob-1", "rayjob-2"]
    head = engines.ray_node(spec, 0, ips, names, 29500)
    worker = engines.ray_node(spec, 2, ips, names, 29500)
    assert head["head"] and not worker["head"]
    assert head["address"] == worker["address"] == "10.0.0.5:29532"
    assert worker["node_ip"] == "10.0.0.7" and worker["num_cpus"] == 2 and worker["num_gpus"] == 1
    assert head["num_cpus"] == 4 and head["num_gpus"] == 0
    assert head["memory"] + head["object_store_memory"] == 16 * 2**30
    assert [e["port"] for e in head["expected"]] == [29533, 29597, 29661] and [
        e["pod"] for e in head["expected"]
    ] == names
    args = raynode.start_args(head, "/tmp/ktray-x")
    assert "--head" in args and "--port=29532" in args and "--num-cpus=4" in args
    assert "--include-dashboard=false" in args and "--block" in args
    args = raynode.start_args(worker, "/tmp/ktray-x")
    assert "--address=10.0.0.5:29532" in args and "--head" not in args and "--num-gpus=1" in args
    assert not any(
        a.startswith(("--port=", "--include-dashboard")) for a in args
    )  # head-only flags


def test_the_cluster_asks_for_a_token_derived_from_the_deployments() -> None:
    spec = _spec()
    cfgs = [
        engines.ray_node(spec, k, ["10.0.0.1"] * 3, ["a", "b", "c"], 29500, token="dep-secret")
        for k in range(3)
    ]
    tokens = {c["auth_token"] for c in cfgs}
    assert len(tokens) == 1 and len(tokens.pop()) == 64 and "dep-secret" not in str(cfgs)
    assert raynode.auth_env(cfgs[0]) == {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": cfgs[0]["auth_token"],
    }
    assert engines.ray_token("other") != cfgs[0]["auth_token"]
    # without one, explicitly off: a ~/.ray/auth_token must not switch some nodes on
    assert raynode.auth_env(
        engines.ray_node(spec, 0, ["10.0.0.1"] * 3, ["a", "b", "c"], 29500)
    ) == {"RAY_AUTH_MODE": "disabled"}
    node = raynode.RayNode(cfgs[0], "rayjob-0", print)
    assert cfgs[0]["auth_token"] not in repr(node.status())


def test_local_nodes_cap_their_object_store() -> None:
    spec = DeploymentSpec(name="r", pod=kt.Compute().distribute("ray", workers=2).pod_spec())
    cfg = engines.ray_node(spec, 1, ["127.0.0.1"] * 3, ["r-0", "r-1", "r-2"], 20000)
    assert engines.MIN_OBJECT_STORE <= cfg["object_store_memory"] <= engines.LOCAL_OBJECT_STORE_MAX
    assert cfg["num_cpus"] is None and cfg["memory"] is None  # Ray counts this machine's CPUs
    assert cfg["ports"]["node_manager"] == 20000 + 32 + 64 + 1


def test_local_object_stores_stay_bounded_whatever_memory_says() -> None:
    # the seed's memory="16Gi" on 5 nodes of one machine: 4.8 GiB of /dev/shm each before
    spec = DeploymentSpec(
        name="r", pod=kt.Compute(memory="16Gi").distribute("ray", workers=4).pod_spec()
    )
    ips, names = ["127.0.0.1"] * 5, [f"r-{k}" for k in range(5)]
    for k in range(5):
        cfg = engines.ray_node(spec, k, ips, names, 20000, one_machine=True)
        assert (
            engines.MIN_OBJECT_STORE <= cfg["object_store_memory"] <= engines.LOCAL_OBJECT_STORE_MAX
        )
        assert cfg["memory"] + cfg["object_store_memory"] == 16 * 2**30  # the heap is the rest
    # a head alone on this machine (one pod: no address repeats) is bounded too
    alone = DeploymentSpec(name="a", pod=kt.Compute().distribute("ray", workers=0).pod_spec())
    cfg = engines.ray_node(alone, 0, ["127.0.0.1"], ["a-0"], 20000, one_machine=True)
    assert engines.MIN_OBJECT_STORE <= cfg["object_store_memory"] <= engines.LOCAL_OBJECT_STORE_MAX
    # a small pod's store stays within its own 30%
    small = DeploymentSpec(
        name="s", pod=kt.Compute(memory="1Gi").distribute("ray", workers=1).pod_spec()
    )
    assert engines.ray_node(small, 1, ["127.0.0.1"] * 2, ["s-0", "s-1"], 20000, one_machine=True)[
        "object_store_memory"
    ] == int(2**30 * 0.3)
    # pods of their own machines split their memory 70/30, as before
    cfg = engines.ray_node(spec, 1, [f"10.0.0.{k}" for k in range(5)], names, 20000)
    assert cfg["object_store_memory"] == int(16 * 2**30 * 0.3)


def test_manifests_size_head_and_worker_pods_apart() -> None:
    spec = _spec(worker_node_options={"gpus": 1, "cpus": "4", "memory": "16Gi"})
    objs = km.render(spec, "default", image="rayproject/ray:2.60.0-py311", install="none")
    sets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}
    assert sorted(sets) == ["rayjob", "rayjob-s1"]
    head, workers = sets["rayjob"]["spec"], sets["rayjob-s1"]["spec"]
    assert (
        head["replicas"] == 1 and workers["replicas"] == 2 and workers["ordinals"] == {"start": 1}
    )
    res = [s["template"]["spec"]["containers"][0]["resources"] for s in (head, workers)]
    assert res[0] == {"requests": {"cpu": "4", "memory": "16Gi"}}
    assert res[1]["requests"]["nvidia.com/gpu"] == "1" and res[1]["limits"] == {
        "nvidia.com/gpu": "1"
    }
    # without worker_node_options every node is the head's size: one StatefulSet
    assert [p.name for p in km.parts(_spec())] == ["rayjob"]


def test_manifests_of_a_ray_cluster_validate() -> None:
    from tests.test_kube_manifests import VERSIONS, _validate

    spec = _spec(
        worker_node_options={"cpus": "2", "memory": "4Gi", "node_selector": {"pool": "cpu"}}
    )
    for obj in km.render(spec, "default", image="rayproject/ray:2.60.0-py311", install="none"):
        for version in VERSIONS:
            _validate(obj, version)


def test_head_names_the_nodes_that_did_not_join() -> None:
    expected = [{"pod": f"r-{k}", "ip": f"10.0.0.{k}", "port": 29533} for k in range(3)]
    found = [
        {"ip": "10.0.0.0", "port": 29533, "alive": True},
        {"ip": "10.0.0.1", "port": 29533, "alive": False},
    ]
    assert [e["pod"] for e in raynode.missing_nodes(expected, found)] == ["r-1", "r-2"]
    # nodes on one host: Ray reports the host's address, so the port tells them apart
    local = [{"pod": f"r-{k}", "ip": "127.0.0.1", "port": 20033 + 64 * k} for k in range(2)]
    assert (
        raynode.missing_nodes(
            local,
            [
                {"ip": "192.0.2.2", "port": 20033, "alive": True},
                {"ip": "192.0.2.2", "port": 20097, "alive": True},
            ],
        )
        == []
    )
    # a head alone (workers=0) is reported by the host's address too
    alone = [{"pod": "r-0", "ip": "127.0.0.1", "port": 20033}]
    assert raynode.missing_nodes(alone, [{"ip": "192.0.2.2", "port": 20033, "alive": True}]) == []
    assert (
        raynode.missing_nodes(alone, [{"ip": "192.0.2.2", "port": 20033, "alive": False}]) == alone
    )


def test_every_pod_is_told_where_the_others_say_their_node_failed() -> None:
    ips, names = ["10.0.0.5", "10.0.0.6", "10.0.0.7"], ["rayjob-0", "rayjob-1", "rayjob-2"]
    urls = [f"http://{ip}:32300" for ip in ips]
    head = engines.engine_settings(_spec(), 0, ips, names, 29500, "l1", urls)
    assert [e.get("health") for e in head["expected"]] == [
        None,
        f"{urls[1]}/health",
        f"{urls[2]}/health",
    ]
    worker = engines.engine_settings(_spec(), 2, ips, names, 29500, "l1", urls)
    assert worker["head_health"] == f"{urls[0]}/health" and "expected" not in worker


def test_ray_waits_as_long_as_the_launch_timeout() -> None:
    env = raynode.startup_env(120)
    assert env == {
        "RAY_raylet_start_wait_time_s": "120",
        "RAY_gcs_server_port_wait_time_s": "120",
        "RAY_agent_register_timeout_ms": "120000",
    }
    assert (
        raynode.startup_env(0.5)["RAY_raylet_start_wait_time_s"] == "1"
    )  # Ray takes whole seconds


def test_a_fatal_line_in_the_nodes_logs_is_found(tmp_path) -> None:
    logs = tmp_path / "session_latest" / "logs"
    assert raynode.fatal_line(str(tmp_path)) is None  # ray start has not got that far
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(
        "[2026-11-26 06:25:25,101 I 11723 11723] (raylet) main.cc:280: Setting cluster ID to: 5f1\n"
        "[2026-11-26 06:25:25,150 W 11723 11723] (raylet) store.cc:40: a warning\n"
    )
    assert raynode.fatal_line(str(tmp_path)) is None
    with open(logs / "raylet.out", "a") as f:
        f.write(
            "[2026-11-26 06:25:25,211 C 11723 11723] (raylet) grpc_server.cc:134: Check failed: "
            "server_ Failed to start the grpc server. The specified port is 24161.\n*** StackTrace ***\n"
        )
    line = raynode.fatal_line(str(tmp_path))
    assert (
        line is not None
        and line.startswith("raylet.out: [2026")
        and "The specified port is 24161" in line
    )


def test_the_seeds_ray_image_spelling() -> None:
    assert kt.images.Ray("2.32.0-py311").image_id == "rayproject/ray:2.32.0-py311"  # seed 004
    # Kubetorch's keyword for the tag
    assert kt.images.ray(v="2.60.0-py312").image_id == "rayproject/ray:2.60.0-py312"
    assert kt.images.Ray().image_id == kt.images.ray().image_id == "rayproject/ray:2.60.0-py311"
    for bad in (2.32, "", "2.32 py311", "rayproject/ray:2.32.0"):
        with pytest.raises(
            kt.ConfigError, match="kt.images.ray\\(tag=.*must be a tag of rayproject/ray"
        ):
            kt.images.Ray(bad)


def test_a_pod_without_ray_names_its_image_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(raynode, "pod_ray_version", lambda: None)
    monkeypatch.setenv("KTLITE_IMAGE", "python:3.11-slim")
    spec = _spec()
    node = raynode.RayNode(
        engines.ray_node(spec, 1, ["10.0.0.1", "10.0.0.2", "10.0.0.3"], ["a", "b", "c"], 29500),
        "rayjob-1",
        print,
    )
    with pytest.raises(
        raynode.EngineError, match="Ray is not installed in python:3.11-slim.*pip_install"
    ):
        asyncio.run(node.start(5))


def test_ray_versions_must_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(raynode, "pod_ray_version", lambda: "2.9.0")
    cfg = {
        **engines.ray_node(_spec(), 0, ["10.0.0.1"] * 3, ["a", "b", "c"], 29500),
        "version": "2.60.0",
    }
    with pytest.raises(raynode.EngineError, match="has Ray 2.9.0, this client Ray 2.60.0"):
        asyncio.run(raynode.RayNode(cfg, "rayjob-0", print).start(5))


def test_a_worker_gives_up_on_a_head_that_never_answers() -> None:
    cfg = engines.ray_node(
        _spec(), 1, ["127.0.0.1"] * 3, ["a", "b", "c"], 1000
    )  # nothing listens there
    cfg["version"] = raynode.pod_ray_version()
    node = raynode.RayNode(cfg, "rayjob-1", print)
    with pytest.raises(
        raynode.EngineError, match="GCS at 127.0.0.1:1032 \\(pod 0\\) did not accept"
    ):
        asyncio.run(node.start(0.5))


def test_a_raylet_that_exits_without_a_fatal_line_fails_the_start(tmp_path) -> None:
    """A raylet killed while ``ray start`` waits for it (OOM, a signal) logs nothing fatal, and
    ``ray start`` would wait the whole launch_timeout (Ray's waits follow it since issue 23):
    the node's watch notices that the raylet, a child of ``ray start``, is gone."""
    import contextlib
    import os
    import shutil
    import signal

    raylet = tmp_path / "raylet"  # a process named "raylet", as Ray's binary is
    os.symlink(shutil.which("sleep"), raylet)
    spec = DeploymentSpec(name="r", pod=kt.Compute().distribute("ray", workers=0).pod_spec())
    node = raynode.RayNode(engines.ray_node(spec, 0, ["127.0.0.1"], ["r-0"], 20000), "r-0", print)
    node.temp_dir = str(tmp_path)  # no session logs: nothing fatal is logged

    async def scenario() -> str:
        node.proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", f"{raylet} 60 & wait")
        watch = asyncio.ensure_future(node._fatal())
        try:
            pid = None
            for _ in range(600):
                await asyncio.sleep(0.05)
                pid = raynode._child_named(node.proc.pid, "raylet")
                if pid is not None:
                    break
            assert pid is not None
            await asyncio.sleep(3 * raynode.WATCH_S)
            assert not watch.done()  # a running raylet is no failure
            os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(watch, 30)
        finally:
            watch.cancel()
            with contextlib.suppress(ProcessLookupError):  # the shell ends with its child
                node.proc.kill()
            await node.proc.wait()

    line = asyncio.run(scenario())
    assert line.startswith("nothing: its raylet (pid ") and line.endswith(") exited"), line
