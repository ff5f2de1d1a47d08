"""The 4-rank gloo all_reduce job the benchmark runs two ways.

- torchrun: ``python -m torch.distributed.run --nproc_per_node=4 --standalone bench/_torchrun_job.py``
- ktlite: ``kt.fn(allreduce_job).to(kt.Compute(cpus=1).distribute("pytorch", workers=2, num_proc=2))()``

Each rank joins the default gloo group from the env (MASTER_ADDR, RANK, ...), all-reduces
its rank number and returns the sum, which must be ``0 + 1 + ... + (WORLD_SIZE - 1)``.
"""

from __future__ import annotations


def allreduce_job() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.full((1,), float(dist.get_rank()))
    dist.all_reduce(t)
    world = dist.get_world_size()
    dist.destroy_process_group()
    value = float(t.item())
    if value != world * (world - 1) / 2:
        raise RuntimeError(f"all_reduce gave {value}, expected {world * (world - 1) / 2}")
    return value


if __name__ == "__main__":
    allreduce_job()
