"""An unmodified torchrun script: no rank arguments, no addresses. Each rank all-reduces
RANK + 1 over gloo and prints one line of what it saw (written in one piece, so that lines
of the two local ranks sharing torchrun's stdout never interleave)."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
seen = {
    "rank": rank,
    "world": world,
    "sum": int(value.item()),
    "argv": sys.argv[1:],
    **{
        k: os.environ.get(k)
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "GROUP_RANK",
            "NODE_RANK",
            "PET_NNODES",
            "PET_NODE_RANK",
        )
    },
}
os.write(1, f"ALLREDUCE {json.dumps(seen)}\n".encode())
dist.destroy_process_group()
