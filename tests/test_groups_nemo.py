"""NeMo RL's own worker-group forms (``nemo_rl/distributed/worker_groups.py``,
``virtual_cluster.py``, ``named_sharding.py`` and their callers in
``nemo_rl/models/policy/lm_policy.py``), written as NeMo writes them with only the import
changed, on real local pods (CPU, no Ray)."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import pytest

import ktlite as kt
from ktlite.groups import (
    NamedSharding,
    RayVirtualCluster,
    RayWorkerBuilder,
    RayWorkerGroup,
    SlicedDataDict,
)
from ktlite.workers.builder import Placement, placement, unwrap_actor
from ktlite.workers.dispatch import plan_sharded, rank0_only


class NemoTestActor:
    """The shape of NeMo's own test actor: records what it was built and called with."""

    def __init__(self, *args, **kwargs):
        self.init_args = args
        self.init_kwargs = kwargs
        self.calls = []

    @staticmethod
    def configure_worker(num_gpus, bundle_indices, num_gpus_per_node=None):
        resources = {"num_gpus": num_gpus}
        env_vars = {"CONFIGURED_WORKER_CALLED": "1"}
        init_kwargs = {"configured_gpus": num_gpus, "bundle_indices": bundle_indices}
        return resources, env_vars, init_kwargs, {}

    def get_init_args_kwargs(self):
        return self.init_args, self.init_kwargs, os.environ.get("CONFIGURED_WORKER_CALLED")

    def record_call(self, data=None, *args, **kwargs):
        rank = int(os.environ["RANK"])
        self.calls.append((data, args, kwargs))
        return {"rank": rank, "data": data, "kwargs": kwargs}

    def take_calls(self):
        calls, self.calls = self.calls, []
        return calls

    def join_store(self, ip, port, world_size):
        """What NeMo's init_collective does with get_master_address_and_port(): every worker
        meets at (ip, port), rank 0 serving."""
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        store = dist.TCPStore(ip, port, world_size, rank == 0, timeout=timedelta(seconds=120))
        store.set(f"rank{rank}", str(rank))
        store.wait([f"rank{r}" for r in range(world_size)])
        seen = [store.get(f"rank{r}").decode() for r in range(world_size)]
        store.set(f"done{rank}", "1")
        if rank == 0:  # the server goes with rank 0's store: wait until every worker has read
            store.wait([f"done{r}" for r in range(world_size)])
        return seen

    def slow_cleanup(self):
        import time

        time.sleep(600)  # a cleanup that hangs: shutdown(timeout=...) stops it

    def shutdown(self):
        marker_dir = self.init_kwargs["marker_dir"]
        with open(os.path.join(marker_dir, f"rank-{os.environ['RANK']}"), "w") as f:
            f.write("cleaned up")
        return True


MY_TEST_ACTOR_FQN = f"{NemoTestActor.__module__}.NemoTestActor"


# ---- the layout and dispatch rules, pure --------------------------------------------------


def test_named_sharding_as_nemo_uses_it() -> None:
    np = pytest.importorskip("numpy")
    sharding = NamedSharding(
        layout=np.arange(8).reshape(2, 2, 1, 2),  # lm_policy's form: PP, DP, CP, TP
        names=["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"],
    )
    assert sharding.shape == {
        "pipeline_parallel": 2,
        "data_parallel": 2,
        "context_parallel": 1,
        "tensor_parallel": 2,
    }
    assert sharding.get_axis_size("data_parallel") == 2 and sharding.size == 8
    assert sharding.get_worker_coords(5) == {
        "pipeline_parallel": 1,
        "data_parallel": 0,
        "context_parallel": 0,
        "tensor_parallel": 1,
    }
    assert sharding.get_ranks_by_coord(data_parallel=1) == [2, 3, 6, 7]
    sub = sharding.get_ranks(pipeline_parallel=1, context_parallel=0)
    assert sub.names == ["data_parallel", "tensor_parallel"] and sub.layout == [[4, 5], [6, 7]]
    assert (
        sharding.get_ranks(
            pipeline_parallel=0, data_parallel=1, context_parallel=0, tensor_parallel=1
        )
        == 3
    )
    assert NamedSharding.is_axis_zero(
        {"tensor_parallel": 0}, ["tensor_parallel", "context_parallel"]
    )
    permuted = NamedSharding([[0, 2], [1, 3]], ["dp", "tp"])
    assert permuted.get_worker_coords(1) == {"dp": 1, "tp": 0}
    with pytest.raises(kt.ConfigError, match="more than once"):
        NamedSharding([[0, 1], [1, 2]], ["dp", "tp"])
    with pytest.raises(kt.ConfigError, match="one name per dimension"):
        NamedSharding([[0, 1], [2, 3]], ["dp"])
    with pytest.raises(kt.ConfigError, match="ragged"):
        NamedSharding([[0, 1], [2]], ["dp", "tp"])
    with pytest.raises(IndexError, match="out of range"):
        sharding.get_ranks(data_parallel=2)


def test_dispatch_follows_nemo_worker_selection() -> None:
    sharding = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    assert rank0_only(sharding, 4, ["tp"]) == [0, 2] and rank0_only(sharding, 4, ["dp", "tp"]) == [
        0
    ]
    assert rank0_only(None, 4, None) == [0, 1, 2, 3]
    with pytest.raises(kt.ConfigError, match="sharding_annotations"):
        rank0_only(None, 4, ["tp"])
    with pytest.raises(kt.ConfigError, match="not in the layout"):
        rank0_only(sharding, 4, ["pp"])
    # tp replicated, output replicated on tp: every worker runs, one result per dp shard
    plan = plan_sharded(sharding, 4, (), {"data": ["A", "B"]}, ["dp"], ["tp"], ["tp"], False)
    assert plan.called == [0, 1, 2, 3] and plan.returned == [0, 2]
    assert [plan.kwargs[w]["data"] for w in plan.called] == ["A", "A", "B", "B"]
    # tp free: only tp 0 is called, unless dummy calls are asked for (with None)
    plan = plan_sharded(sharding, 4, (), {"data": ["A", "B"]}, ["dp"], [], [], False)
    assert plan.called == [0, 2] and plan.returned == [0, 2]
    plan = plan_sharded(sharding, 4, (), {"data": ["A", "B"]}, ["dp"], None, None, True)
    assert plan.called == [0, 1, 2, 3] and plan.returned == [0, 2]
    assert [plan.kwargs[w]["data"] for w in plan.called] == ["A", None, "B", None]
    with pytest.raises(kt.ConfigError, match="3 item.*size is 2"):
        plan_sharded(sharding, 4, (), {"data": ["A", "B", "C"]}, ["dp"], ["tp"], [], False)
    with pytest.raises(kt.ConfigError, match="one level per sharded axis"):
        plan_sharded(sharding, 4, (), {"data": [["A", "B"], "C"]}, ["dp", "tp"], [], [], False)
    with pytest.raises(kt.ConfigError, match="both"):
        plan_sharded(sharding, 4, (), {"data": ["A", "B"]}, ["dp"], ["dp"], [], False)


def test_placement_is_nemos_tied_worker_layout() -> None:
    alone = placement([2, 2], None, None)
    assert alone.leaders == [0, 1, 2, 3] and alone.metadata("policy")[3] == {
        "node_idx": 1,
        "local_rank": 0,
        "global_rank": 3,
        "name": "policy-1-1",
        "bundle_indices": (1, [1]),
        "dp_shard_idx": 3,
    }
    tied = placement([4], [4], [(0, [0, 1]), (0, [2, 3])])
    assert isinstance(tied, Placement) and tied.leaders == [0, 2]
    assert tied.bundle_indices() == ((0, [0, 1]), None, (0, [2, 3]), None)
    assert [m["name"] for m in tied.metadata("gen")] == [
        "gen-grp0-0",
        "gen-grp0-1",
        "gen-grp1-0",
        "gen-grp1-1",
    ]
    with pytest.raises(kt.ConfigError, match="every rank of the cluster"):
        placement([4], None, [(0, [1, 0]), (0, [2, 3])])
    with pytest.raises(kt.ConfigError, match="one worker per rank"):
        placement([2, 2], 1, None)


def test_nemo_names_are_importable_from_ktlite_groups() -> None:
    from ktlite import groups
    from ktlite.api import sharding
    from ktlite.workers import batched, builder, dispatch, virtual_cluster

    assert (groups.BatchedDataDict, groups.SlicedDataDict) == (
        batched.BatchedDataDict,
        batched.SlicedDataDict,
    )
    assert (
        groups.RayWorkerBuilder is builder.WorkerBuilder
        and groups.NamedSharding is sharding.NamedSharding
    )
    assert groups.RayVirtualCluster is virtual_cluster.VirtualCluster
    assert groups.MultiWorkerFuture is dispatch.MultiWorkerFuture
    assert sorted(groups.__all__) == groups.__all__ and all(
        hasattr(groups, n) for n in groups.__all__
    )


def test_ray_remote_classes_are_unwrapped() -> None:
    ray = pytest.importorskip("ray")

    class Policy:
        pass

    assert unwrap_actor(ray.remote(Policy)) is Policy
    assert unwrap_actor(Policy) is Policy


def test_nemo_options_are_checked_before_anything_starts() -> None:
    with pytest.raises(kt.ConfigError, match="import path"):
        RayWorkerBuilder("NoModule")
    cluster = RayVirtualCluster(bundle_ct_per_node_list=[2, 2], use_gpus=False, port_range_low=1500)
    assert (
        cluster.world_size() == 4
        and cluster.node_count() == 2
        and cluster._sorted_bundle_indices is None
    )
    builder = RayWorkerBuilder(MY_TEST_ACTOR_FQN, token="s3cr3t")
    assert "s3cr3t" not in repr(builder)
    with pytest.raises(kt.ConfigError, match="one worker per rank"):
        RayWorkerGroup(cluster=cluster, remote_worker_builder=builder, workers_per_node=1)
    with pytest.raises(kt.ConfigError, match="exactly the group's 4 workers"):
        RayWorkerGroup(cluster, builder, sharding_annotations=NamedSharding([0, 1], ["dp"]))
    with pytest.raises(kt.ConfigError, match="holds the worker's constructor arguments"):
        RayWorkerGroup(cluster, builder, "positional")
    with pytest.raises(kt.ConfigError, match="NVLink"):
        RayVirtualCluster([2], segment_size=4)
    with pytest.raises(kt.ConfigError, match="no pods yet"):
        cluster.get_master_address_and_port()
    assert cluster.groups == []


# ---- on real pods ---------------------------------------------------------------------


def test_nemo_worker_group_forms_on_real_ranks(tmp_path, caplog) -> None:
    cluster = RayVirtualCluster(
        bundle_ct_per_node_list=[2, 2],
        use_gpus=False,
        max_colocated_worker_groups=2,
        name="nemo-forms",
    )
    try:
        builder = RayWorkerBuilder(
            MY_TEST_ACTOR_FQN, "arg1", 123, kwarg1="value1", marker_dir=str(tmp_path)
        )
        sharding = NamedSharding(layout=[[0, 1], [2, 3]], names=["dp", "tp"])
        worker_group = RayWorkerGroup(
            cluster=cluster,
            remote_worker_builder=builder,
            name_prefix="policy",
            bundle_indices_list=[(0, [0, 1]), (1, [0, 1])],  # tied groups, as vLLM's TP=2
            sharding_annotations=sharding,
            env_vars={},
        )
        assert len(worker_group.workers) == 4 and worker_group.dp_size == 2
        assert [worker_group.get_dp_leader_worker_idx(i) for i in range(2)] == [0, 2]
        assert [m["name"] for m in worker_group.worker_metadata] == [
            "policy-grp0-0", "policy-grp0-1", "policy-grp1-0", "policy-grp1-1",
        ]  # fmt: skip

        # the builder's arguments, configure_worker's keywords and environment, on every rank
        built = worker_group.run_all_workers_single_data("get_init_args_kwargs")
        for rank, (args, kwargs, configured) in enumerate(built):
            assert args == ("arg1", 123) and configured == "1"
            assert kwargs["kwarg1"] == "value1" and kwargs["configured_gpus"] == 0
            assert kwargs["bundle_indices"] == ({0: (0, [0, 1]), 2: (1, [0, 1])}.get(rank))

        # run_rank_0_only_axes: only tp 0 runs, and gets its own item of the data
        data_for_dp = [SlicedDataDict({"id": [0, 1]}), SlicedDataDict({"id": [2, 3]})]
        only = worker_group.run_all_workers_single_data(
            "record_call", data=data_for_dp[0], run_rank_0_only_axes=["tp"]
        )
        assert [r["rank"] for r in only] == [0, 2]
        multi = worker_group.run_all_workers_multiple_data(
            "record_call", data=data_for_dp, run_rank_0_only_axes=["tp"], common_kwargs={"step": 7}
        )
        assert [(r["rank"], r["data"]["id"], r["kwargs"]) for r in multi] == [
            (0, [0, 1], {"step": 7}),
            (2, [2, 3], {"step": 7}),
        ]
        calls = worker_group.run_all_workers_single_data("take_calls")
        assert [len(c) for c in calls] == [2, 0, 2, 0]

        # lm_policy's sharded call: dp sharded, tp replicated, the output kept once per dp shard
        futures = worker_group.run_all_workers_sharded_data(
            "record_call",
            data=data_for_dp,
            in_sharded_axes=["dp"],
            replicate_on_axes=["tp"],
            output_is_replicated=["tp"],
            common_kwargs={"micro_batch_size": 2},
        )
        results = worker_group.get_all_worker_results(futures)
        assert [(r["rank"], r["data"]["id"], r["kwargs"]) for r in results] == [
            (0, [0, 1], {"micro_batch_size": 2}),
            (2, [2, 3], {"micro_batch_size": 2}),
        ]
        calls = worker_group.run_all_workers_single_data("take_calls")
        assert [[c[0]["id"] for c in rank_calls] for rank_calls in calls] == [
            [[0, 1]],
            [[0, 1]],
            [[2, 3]],
            [[2, 3]],
        ]

        # tp free: tp 1 is not called, or called with None for each argument (dummy calls)
        futures = worker_group.run_all_workers_sharded_data(
            "record_call", data=data_for_dp, in_sharded_axes=["dp"]
        )
        assert [r["rank"] for r in worker_group.get_all_worker_results(future_bundle=futures)] == [
            0,
            2,
        ]
        futures = worker_group.run_all_workers_sharded_data(
            "record_call",
            data=data_for_dp,
            in_sharded_axes=["dp"],
            make_dummy_calls_to_free_axes=True,
        )
        assert [r["rank"] for r in worker_group.get_all_worker_results(futures)] == [0, 2]
        calls = worker_group.run_all_workers_single_data("take_calls")
        assert [[c[0] and c[0]["id"] for c in rank_calls] for rank_calls in calls] == [
            [[0, 1], [0, 1]], [None], [[2, 3], [2, 3]], [None],
        ]  # fmt: skip
        with pytest.raises(kt.ConfigError, match="along axis 'dp'"):
            worker_group.run_all_workers_sharded_data(
                "record_call", data=data_for_dp[:1], in_sharded_axes=["dp"]
            )

        # addresses and ports on the pods, usable for a rendezvous of every worker
        ip, port = cluster.get_master_address_and_port()
        ip2, port2 = cluster.get_master_address_and_port()
        assert ip2 == ip and port2 != port and 1400 <= port < 2000
        assert (
            worker_group.run_all_workers_single_data("join_store", ip=ip, port=port, world_size=4)
            == [["0", "1", "2", "3"]] * 4
        )
        batch = cluster.get_available_addresses_and_ports_batch([(0, 0), (0, 0), (1, 1)])
        assert batch[0][0] == batch[1][0] == ip and batch[0][1] != batch[1][1]
        assert cluster.get_available_address_and_port(1, 1)[0] == batch[2][0]

        # a colocated group whose cleanup fails, or hangs: shutdown says so, removes it anyway
        generation = RayWorkerGroup(
            cluster, RayWorkerBuilder(MY_TEST_ACTOR_FQN), name_prefix="generation"
        )
        assert generation.shutdown(cleanup_method="no_such_method") is False
        generation = RayWorkerGroup(
            cluster, RayWorkerBuilder(MY_TEST_ACTOR_FQN), name_prefix="generation"
        )
        with caplog.at_level(logging.WARNING, logger="ktlite.groups"):
            assert generation.shutdown(cleanup_method="slow_cleanup", timeout=1) is False
        assert "slow_cleanup did not end within 1s" in caplog.text
        assert cluster.groups == [worker_group]
        assert worker_group.run_all_workers_single_data("take_calls") == [[], [], [], []]

        # shutdown runs the cleanup method on every worker first
        assert worker_group.shutdown(cleanup_method="shutdown", timeout=60) is True
        assert sorted(os.listdir(tmp_path)) == [f"rank-{r}" for r in range(4)]
        assert worker_group.shutdown(force=True) is True and cluster.groups == []
    finally:
        cluster.shutdown()
