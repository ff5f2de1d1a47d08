"""Pods of different sizes: ``distribute(num_proc=[...])``: rank maths, validation, and a
real gloo all_reduce across [1, 2, 1]."""

from __future__ import annotations

import os

import pytest

import ktlite as kt
from ktlite.specs.spec import DistributedConfig, distributed_env


def test_sizes_ranks_and_ordinals() -> None:
    d = kt.Compute().distribute("pytorch", num_proc=[4, 8, 2]).distributed
    assert d.workers == 3 and d.sizes == (4, 8, 2) and d.world_size == 14 and not d.uniform
    assert [d.first_rank(o) for o in range(3)] == [0, 4, 12]
    assert [d.ordinal_of(r) for r in (0, 3, 4, 11, 12, 13)] == [0, 0, 1, 1, 2, 2]
    assert d.procs(1) == 8 and d.max_procs == 8
    # a uniform list is the plain form
    same = kt.Compute().distribute("pytorch", num_proc=[2, 2]).distributed
    assert same.num_proc == 2 and same.uniform and same.workers == 2
    assert same == kt.Compute().distribute("pytorch", workers=2, num_proc=2).distributed


def test_env_of_an_uneven_layout() -> None:
    d = DistributedConfig(framework="pytorch", workers=3, num_proc=(1, 2, 1))
    ips = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    envs = [
        distributed_env(d, node_rank=o, local_rank=lr, pod_ips=ips, master_port=29500)
        for o in range(3)
        for lr in range(d.procs(o))
    ]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["1", "2", "2", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["NODE_RANK"] for e in envs] == ["0", "1", "1", "2"]
    with pytest.raises(ValueError, match="local rank 1"):
        distributed_env(d, node_rank=2, local_rank=1, pod_ips=ips, master_port=29500)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"workers": 2, "num_proc": [1, 2, 3]}, "workers=2"),
        ({"num_proc": []}, "names no pod"),
        ({"num_proc": [1, 0]}, r"num_proc\[1\]"),
        ({"num_proc": [1, "2"]}, r"num_proc\[1\]"),
    ],
)
def test_bad_layouts_are_refused(kwargs, match) -> None:
    with pytest.raises(kt.ConfigError, match=match):
        kt.Compute().distribute("pytorch", **kwargs)


def test_gpu_pods_of_different_sizes_get_a_gpu_per_rank_or_gpus_where_more() -> None:
    def pod_gpus(compute: kt.Compute) -> list[int]:
        return [compute.pod_gpus(o) for o in range(compute.distributed.workers)]

    assert pod_gpus(kt.Compute(gpus=1).distribute("pytorch", num_proc=[4, 8, 2])) == [4, 8, 2]
    assert pod_gpus(kt.Compute(gpus=4).distribute("pytorch", num_proc=[4, 8, 2])) == [4, 8, 4]
    assert pod_gpus(kt.Compute(gpus=2).distribute("pytorch", workers=3)) == [2, 2, 2]
    assert pod_gpus(kt.Compute().distribute("pytorch", num_proc=[1, 2])) == [0, 0]
    # even pods: gpus is each pod's count, and must cover its ranks
    with pytest.raises(kt.ConfigError, match="pod of 4 ranks, more than gpus=2"):
        kt.Compute(gpus=2).distribute("pytorch", workers=2, num_proc=4)


def test_local_gpu_pods_of_different_sizes_split_the_machines_gpus(monkeypatch) -> None:
    from ktlite.backends import local, local_pods
    from ktlite.specs.deployment_spec import DeploymentSpec

    spec = DeploymentSpec(
        "uneven-gpus", kt.Compute(gpus=1).distribute("pytorch", num_proc=[1, 2, 1]).pod_spec()
    )
    monkeypatch.setattr(local_pods, "visible_gpus", lambda: ["0", "1", "2"])
    with pytest.raises(
        kt.ConfigError,
        match=r"pods of \[1, 2, 1\] GPUs \(one per rank\) needs 4 GPU\(s\), "
        "but this machine has 3",
    ):
        local.LocalBackend().plan(spec)
    monkeypatch.setattr(local_pods, "visible_gpus", lambda: ["0", "1", "2", "3", "4"])
    backend = local.LocalBackend()
    backend.plan(spec)
    assert [backend._env(spec, o)["CUDA_VISIBLE_DEVICES"] for o in range(3)] == ["0", "1,2", "3"]


def all_reduce() -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    env = {
        k: os.environ[k]
        for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "NODE_RANK")
    }
    return {"sum": t.item(), **env}


def test_gloo_all_reduce_across_1_2_1() -> None:
    remote = kt.fn(all_reduce).to(
        kt.Compute().distribute("pytorch", num_proc=[1, 2, 1]), name="uneven-121"
    )
    try:
        got = remote()
        assert [g["RANK"] for g in got] == ["0", "1", "2", "3"]  # results in rank order
        assert all(g["sum"] == 10.0 for g in got)  # 1 + 2 + 3 + 4
        assert [(g["NODE_RANK"], g["LOCAL_RANK"], g["LOCAL_WORLD_SIZE"]) for g in got] == [
            ("0", "0", "1"),
            ("1", "0", "2"),
            ("1", "1", "2"),
            ("2", "0", "1"),
        ]
        assert {g["WORLD_SIZE"] for g in got} == {"4"}
        assert all(ln.startswith("[uneven-121-1]") for ln in remote.logs(rank=2).splitlines())
        status = remote.status()
        assert [[r["rank"] for r in pod["ranks"]] for pod in status] == [[0], [1, 2], [3]]
    finally:
        remote.teardown()


def whoami(item: object) -> tuple:
    return int(os.environ["RANK"]), item


def test_per_rank_items_on_uneven_pods() -> None:
    remote = kt.fn(whoami).to(kt.Compute().distribute("spmd", num_proc=[2, 1]), name="uneven-each")
    try:
        assert remote.each(["a", "b", "c"]) == [(0, "a"), (1, "b"), (2, "c")]
    finally:
        remote.teardown()
