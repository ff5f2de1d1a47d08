"""The NeMo RL face (``ktlite.groups``): the seed's worker-group calls, with only the import
changed, on real local pods (CPU, no Ray)."""

from __future__ import annotations

import os
import time

import pytest

import ktlite as kt
from ktlite.groups import (
    RayVirtualCluster,
    RayWorkerGroup,
    VirtualCluster,
    WorkerFailureError,
    WorkerGroup,
)


class PolicyWorker:
    def __init__(self, lr: float = 0.1) -> None:
        self.lr = lr
        self.steps = 0

    def train_step(self, batch: list[float]) -> dict:
        self.steps += 1
        return {
            "rank": int(os.environ["RANK"]),
            "loss": sum(batch) * self.lr,
            "steps": self.steps,
            "pid": os.getpid(),
        }

    def crash(self, rank: int) -> None:
        if int(os.environ["RANK"]) == rank:
            os._exit(9)
        time.sleep(0.5)


class GenerationWorker:
    def generate(self, prompt: str, suffix: str = "!") -> dict:
        return {"rank": int(os.environ["RANK"]), "text": prompt + suffix, "pid": os.getpid()}


def test_bad_options_are_refused_before_anything_starts() -> None:
    with pytest.raises(kt.ConfigError, match="one whole number"):
        VirtualCluster([2, 0])
    with pytest.raises(kt.ConfigError, match="gpu_ids"):
        VirtualCluster([2], gpu_ids=[0, 1])
    cluster = VirtualCluster([1])
    with pytest.raises(kt.ConfigError, match="enable_gradient_compression"):
        WorkerGroup(cluster, PolicyWorker, enable_gradient_compression=True)
    with pytest.raises(kt.ConfigError, match="unknown"):
        WorkerGroup(cluster, PolicyWorker, colour="red")
    assert cluster.groups == [] and cluster.get_placement_groups() == [[0]]
    assert RayVirtualCluster is VirtualCluster and RayWorkerGroup is WorkerGroup


def test_seed_patterns_on_uneven_nodes_with_a_colocated_group() -> None:
    cluster = RayVirtualCluster([1, 2], max_colocated_worker_groups=2, name="nemo-face")
    try:
        assert cluster.get_placement_groups() == [[0], [1, 2]] and cluster.world_size() == 3
        policy = RayWorkerGroup(cluster, PolicyWorker, init_args={"lr": 0.5})
        losses = policy.run_all_workers_single_data("train_step", [1.0, 3.0])
        assert [(x["rank"], x["loss"], x["steps"]) for x in losses] == [
            (r, 2.0, 1) for r in range(3)
        ]

        generation = RayWorkerGroup(cluster, GenerationWorker)  # colocated: same processes
        outs = generation.run_all_workers_multiple_data(
            "generate", ["p0", "p1", "p2"], suffix=["?", "!", "."]
        )
        assert [o["text"] for o in outs] == ["p0?", "p1!", "p2."]
        assert [o["pid"] for o in outs] == [x["pid"] for x in losses]
        shared = generation.run_all_workers_multiple_data(
            "generate", ["a", "b", "c"], common_kwargs={"suffix": "#"}
        )
        assert [o["text"] for o in shared] == ["a#", "b#", "c#"]
        one = generation.run_single_worker_single_data("generate", 2, "solo")
        assert one["rank"] == 2 and one["text"] == "solo!"

        futures = policy.run_all_workers_single_data("train_step", [1.0], _async=True)
        assert [x["steps"] for x in policy.get_all_worker_results(futures, timeout=60)] == [2, 2, 2]
        single = generation.run_single_worker_single_data("generate", 0, "f", _async=True)
        assert generation.get_all_worker_results([single])[0]["text"] == "f!"

        status = policy.get_worker_status()
        assert [s["rank"] for s in status] == [0, 1, 2] and all(
            s["state"] == "idle" for s in status
        )
        usage = policy.get_resource_usage()
        assert all(u["rss_bytes"] and u["rss_bytes"] > 0 for u in usage)
        assert policy.detect_stuck_workers(threshold_s=60) == []

        with pytest.raises(WorkerFailureError, match="rank 1"):
            policy.run_all_workers_single_data("crash", 1)
        assert policy.restart_failed_workers() == [1]
        after = policy.run_all_workers_single_data("train_step", [1.0])
        assert [x["steps"] for x in after] == [3, 1, 3]  # only rank 1 started over

        with pytest.raises(kt.ConfigError, match="maximum"):
            WorkerGroup(cluster, GenerationWorker)
        with pytest.raises(kt.ConfigError, match="per worker"):
            generation.run_all_workers_multiple_data("generate", "abc")
    finally:
        cluster.shutdown()
    assert cluster.groups == []
