"""The Kubetorch docs' `train_fn` on 2 workers x 2 processes: 4 ranks, 4 strings back.

Run from the repository root (needs torch):

    python examples/train_fn.py
"""

from __future__ import annotations

import ktlite as kt


def train_fn() -> str:
    import os

    import torch

    # ktlite sets these env vars for you
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    torch.distributed.init_process_group(backend="gloo")  # "nccl" on GPUs
    torch.distributed.barrier()  # every rank joined
    torch.distributed.destroy_process_group()  # the rank process lives on for the next call
    pod = os.environ["KTLITE_POD_NAME"]
    return f"Rank {rank}/{world_size} initialized on {os.uname().nodename} (pod {pod})"


if __name__ == "__main__":
    compute = kt.Compute(cpus=2).distribute("pytorch", workers=2, num_proc=2)
    remote = kt.fn(train_fn).to(compute)
    try:
        for line in remote():  # results[r] came from RANK r
            print(line)
    finally:
        remote.teardown()
