"""distribute("monarch") without running Monarch: the options, every pod's worker loop
settings (unix sockets where pods share a machine, TCP on pod IPs on a cluster), the
controller's environment, the NetworkPolicy of a cluster deployment, and the failures that
need no mesh. The real mesh is in test_monarch.py."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

import ktlite as kt
from ktlite import distributed
from ktlite.backends import kube_manifests as km
from ktlite.modes import engines
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.spec import GROUP_PORTS, DistributedConfig
from ktlite_server import monarchhost
from ktlite_server.engine import EngineError
from ktlite_server.rank import _task_cause
from ktlite_wire.distenv import DistributedLayout


def job() -> int:
    return 1


def _spec(workers: int = 2, num_proc: int = 4) -> DeploymentSpec:
    return DeploymentSpec(
        name="mesh",
        pod=kt.Compute(cpus="4")
        .distribute("monarch", workers=workers, num_proc=num_proc)
        .pod_spec(),
    )


def test_num_proc_is_the_procs_per_host_and_one_controller_rank() -> None:
    d = kt.Compute().distribute("monarch", workers=3, num_proc=4).distributed
    assert (d.workers, d.num_proc, d.procs_per_host, d.world_size, d.engine) == (3, 1, 4, 3, True)
    assert (
        kt.Compute(gpus=2).distribute("monarch", workers=2).distributed.procs_per_host == 2
    )  # one per GPU
    assert kt.Compute().distribute("monarch").distributed.workers == 1
    again = DistributedLayout.from_json(
        json.loads(json.dumps(asdict(d)))
    )  # as a pod server rebuilds it
    assert asdict(again) == asdict(d) and again.world_size == d.world_size
    assert d.port_span == GROUP_PORTS + 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"workers": 2, "num_proc": [2, 4]}, "same procs on every host"),
        ({"workers": 2, "num_proc": 0}, "num_proc=0"),
        ({"workers": 0}, "workers=0"),
        ({"workers": 2, "worker_node_options": {"cpus": 2}}, "only framework='ray'"),
        ({"workers": 2, "port": 65530}, "no room for the Monarch worker loops' ports"),
    ],
)
def test_bad_monarch_options_are_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(kt.ConfigError, match=match):
        spec = DeploymentSpec(name="m", pod=kt.Compute().distribute("monarch", **kwargs).pod_spec())
        engines.monarch_host(
            spec, 1, ["10.0.0.1", "10.0.0.2"], ["m-0", "m-1"], spec.distributed.port, "l1"
        )


def test_procs_per_host_belongs_to_monarch() -> None:
    with pytest.raises(kt.ConfigError, match="procs_per_host=2 is Monarch's"):
        DistributedConfig(framework="pytorch", workers=2, procs_per_host=2)
    with pytest.raises(kt.ConfigError, match="give the procs per host once"):
        DistributedConfig(framework="monarch", workers=2, num_proc=2, procs_per_host=3)


def test_cluster_pods_use_tcp_on_their_ips_at_pinned_ports() -> None:
    ips, names = ["10.0.0.5", "10.0.0.6"], ["mesh-0", "mesh-1"]
    head = engines.monarch_host(_spec(), 0, ips, names, 29500, "launch1")
    other = engines.monarch_host(_spec(), 1, ips, names, 29500, "launch1")
    assert head["transport"] == other["transport"] == "tcp" and head["head"] and not other["head"]
    assert [h["port"] for h in head["hosts"]] == [29500 + GROUP_PORTS, 29501 + GROUP_PORTS]
    assert monarchhost.address(other, 1) == f"tcp://10.0.0.6:{29501 + GROUP_PORTS}"
    env = json.loads(monarchhost.MonarchHost.rank_env(head)["KTLITE_MONARCH"])
    assert env == {
        "workers": [f"tcp://10.0.0.5:{29532}", f"tcp://10.0.0.6:{29533}"],
        "per_host": 4,
        "controller": "tcp://10.0.0.5:0",
        "generation": "launch1",
    }
    assert monarchhost.MonarchHost.rank_env(other) == {}  # only the controller attaches
    # every .to() brings fresh loops: the settings differ by launch, so pods restart them
    assert engines.monarch_host(_spec(), 1, ips, names, 29500, "launch2") != other


def test_pods_on_one_machine_use_private_unix_sockets() -> None:
    cfg = engines.monarch_host(
        _spec(), 1, ["127.0.0.1"] * 2, ["mesh-0", "mesh-1"], 20000, "launch1"
    )
    assert cfg["transport"] == "ipc" and cfg["ipc_dir"].startswith("ktmon-")
    addr = monarchhost.address(cfg, 1)
    assert addr.startswith("ipc://") and addr.endswith(f"/{cfg['ipc_dir']}/1")
    assert len(addr) - len("ipc://") < 100  # a unix socket path must fit 107 bytes


def test_engine_settings_pick_the_framework() -> None:
    cfg = engines.engine_settings(
        _spec(),
        0,
        ["10.0.0.5", "10.0.0.6"],
        ["a", "b"],
        29500,
        "l1",
        "http://10.0.0.5:32300",
        "token",
    )
    assert cfg["kind"] == "monarch" and "token" not in json.dumps(cfg)


def test_the_socket_directory_must_be_this_users_alone(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    monarchhost.private_dir(str(mine))
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    monarchhost.private_dir(str(mine))  # ours already: fine
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(EngineError, match="not a private directory"):
        monarchhost.private_dir(str(shared))
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(EngineError, match="not a private directory"):
        monarchhost.private_dir(str(link))


def test_a_pod_without_monarch_names_its_image_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(monarchhost, "pod_monarch_version", lambda: None)
    monkeypatch.setenv("KTLITE_IMAGE", "python:3.11-slim")
    cfg = engines.monarch_host(
        _spec(), 1, ["10.0.0.5", "10.0.0.6"], ["mesh-0", "mesh-1"], 29500, "l1"
    )
    with pytest.raises(
        EngineError,
        match="pod mesh-1: Monarch is not installed in python:3.11-slim.*"
        "pip_install\\('torchmonarch'\\)",
    ):
        asyncio.run(monarchhost.MonarchHost(cfg, "mesh-1", print).start(5))


def test_the_controller_names_loops_that_never_answer() -> None:
    cfg = engines.monarch_host(
        _spec(), 0, ["127.0.0.2", "127.0.0.3"], ["mesh-0", "mesh-1"], 1000, "l1"
    )
    host = monarchhost.MonarchHost(cfg, "mesh-0", print)  # nothing listens at ports 1032, 1033
    with pytest.raises(
        EngineError,
        match="0 of 2 Monarch worker loops accept connections.*"
        "mesh-0 \\(tcp://127.0.0.2:1032\\), mesh-1 \\(tcp://127.0.0.3:1033\\)",
    ):
        asyncio.run(host.await_cluster(0.3))


def test_monarch_hosts_outside_a_controller_says_where_it_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KTLITE_MONARCH", raising=False)
    monkeypatch.delenv("KTLITE_FRAMEWORK", raising=False)
    with pytest.raises(
        kt.KtliteError, match="distribute\\('monarch', ...\\).*this process is not one"
    ):
        distributed.monarch_hosts()
    monkeypatch.setenv("KTLITE_FRAMEWORK", "pytorch")
    with pytest.raises(kt.KtliteError, match="this one is distribute\\('pytorch'\\)"):
        distributed.monarch_procs()


def test_calls_go_to_the_controller_only() -> None:
    from ktlite.modes.deploy import CallOptions, Deployment, mode_for
    from ktlite.modes.fanout import HeadOnly

    dep = Deployment.__new__(Deployment)
    dep.spec = _spec()
    mode = mode_for(dep.spec)(dep)  # the strategy chosen at deploy
    assert isinstance(mode, HeadOnly) and mode.single
    for options, per_rank in ((CallOptions(workers=[1]), None), (CallOptions(), {"x": 1})):
        with pytest.raises(
            kt.ConfigError, match="Monarch mesh: a call runs once, on pod 0.*workers= and ranks="
        ):
            mode.head_options(options, per_rank)
    assert mode.head_options(CallOptions(), None) == CallOptions(ranks=[0])


def test_an_endpoint_error_is_unwrapped_to_its_own_type() -> None:
    actor_mesh = pytest.importorskip("monarch._src.actor.actor_mesh")
    cause = KeyError("no shard 7")
    wrapped = actor_mesh.ActorError(cause, "Actor call shard.load failed.")
    assert _task_cause(wrapped) is cause


def test_manifests_limit_the_pods_ports_to_the_deployment() -> None:
    from tests.test_kube_manifests import VERSIONS, _validate

    objs = km.render(_spec(), "default", image="ktlite-server-monarch:dev", install="none")
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    kinds = [o["kind"] for o in objs]
    assert kinds.index("NetworkPolicy") < kinds.index("StatefulSet")  # before any pod exists
    rules = policy["spec"]["ingress"]
    assert rules[0] == {"ports": [{"protocol": "TCP", "port": km.SERVER_PORT}]}
    assert rules[1]["from"] == [{"podSelector": {"matchLabels": {km.NAME_LABEL: "mesh"}}}]
    assert policy["spec"]["podSelector"]["matchLabels"] == {km.NAME_LABEL: "mesh"}
    for version in VERSIONS:
        for obj in objs:
            _validate(obj, version)
    # every deployment has one now, Monarch's as any other's
    ddp = DeploymentSpec(name="ddp", pod=kt.Compute().distribute("pytorch", workers=2).pod_spec())
    (other,) = [
        o
        for o in km.render(ddp, "default", image="x", install="none")
        if o["kind"] == "NetworkPolicy"
    ]
    assert other["spec"]["ingress"][0] == rules[0]
