"""A plain torchrun DDP script: a tiny model, gloo, a few steps; prints the loss per rank.

It takes no rank arguments: torchrun reads them from the PET_* env that kt.app sets (see
torchrun_app.py). On its own: `torchrun --nproc_per_node=2 train_ddp.py --steps 5`.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world_size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)  # each rank its own shard of synthetic data
x = torch.randn(32, 8, generator=gen)
y = x.sum(dim=1, keepdim=True)

for step in range(args.steps):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # DDP averages the gradients across all ranks
    optimizer.step()
    print(f"rank {rank}/{world_size} step {step}: loss {loss.item():.4f}", flush=True)

dist.destroy_process_group()
