"""A GRPO-shaped single-controller loop on worker groups, on CPU (local backend, gloo).

A policy group (2 pods x 2 ranks) trains a small model with DDP; a generation group
colocated in the same rank processes answers per-rank prompts; results come back by rank.
Midway one rank is killed: the step fails naming it, only that rank is restarted, the other
ranks keep their model, and the loop goes on with a fresh process group.

    python examples/worker_groups.py
"""

from __future__ import annotations

import os
import time

from ktlite.groups import VirtualCluster, WorkerFailureError, WorkerGroup


class PolicyWorker:
    """One DDP replica of a tiny policy; ``train_step`` re-forms the process group on demand."""

    def __init__(self, lr: float) -> None:
        import torch

        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.lr = lr
        self.steps = 0

    def train_step(self, rewards: list[float]) -> dict:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")  # the first call forms it; after a restart, a new one
        ddp = DDP(self.model)
        opt = torch.optim.SGD(ddp.parameters(), lr=self.lr)
        x = torch.randn(8, 4) + dist.get_rank()
        loss = ((ddp(x).squeeze() - torch.tensor(rewards).mean()) ** 2).mean()
        opt.zero_grad()
        loss.backward()  # gradients all-reduced across the 4 ranks
        opt.step()
        self.steps += 1
        return {
            "rank": dist.get_rank(),
            "loss": round(loss.item(), 4),
            "steps": self.steps,
            "pid": os.getpid(),
        }

    def crash_if(self, rank: int) -> None:
        if int(os.environ["RANK"]) == rank:
            os._exit(1)  # a rank dying mid-step (an OOM, a segfault)
        time.sleep(0.2)


class GenerationWorker:
    """Answers a prompt per rank (a stand-in for vLLM), in the policy's processes."""

    def generate(self, prompt: str) -> dict:
        rank = int(os.environ["RANK"])
        return {
            "rank": rank,
            "pid": os.getpid(),
            "completion": f"{prompt} -> answer from rank {rank}",
        }


def main() -> None:
    cluster = VirtualCluster([2, 2], max_colocated_worker_groups=2, name="grpo")
    try:
        policy = WorkerGroup(cluster, PolicyWorker, init_args={"lr": 0.05})
        generation = WorkerGroup(cluster, GenerationWorker)  # same pods, same processes
        for step in range(4):
            prompts = [f"step {step} prompt {r}" for r in range(cluster.world_size())]
            outs = generation.run_all_workers_multiple_data("generate", prompts)
            rewards = [float(len(o["completion"]) % 7) for o in outs]
            if step == 2:
                try:
                    policy.run_all_workers_single_data("crash_if", 3)
                except WorkerFailureError as e:
                    print(f"step {step}: a rank died: {str(e).splitlines()[0]}")
                    print(f"step {step}: restarted only rank(s) {policy.restart_failed_workers()}")
            losses = policy.run_all_workers_single_data("train_step", rewards)
            print(
                f"step {step}: losses by rank {[x['loss'] for x in losses]}, "
                f"steps by rank {[x['steps'] for x in losses]}, "
                f"same processes as generation: {[x['pid'] for x in losses] == [o['pid'] for o in outs]}"
            )
        usage = policy.get_resource_usage()
        print("RSS MiB by rank:", [round(u["rss_bytes"] / 2**20) for u in usage])
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
