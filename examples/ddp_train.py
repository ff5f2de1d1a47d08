"""Distributed data-parallel training with PyTorch DDP on 2 workers x 2 processes (gloo, CPU).

Run from the repository root (needs torch and numpy: ``pip install -e ".[examples]"`` installs them):

    python examples/ddp_train.py

Each of the 4 ranks trains the same tiny model on its own shard of synthetic data. DDP
averages the gradients across ranks every step, so after training every rank must hold
exactly the same weights: the script checks that. Every rank's prints stream back live,
prefixed with "[rank R @ POD]".
"""

from __future__ import annotations

import ktlite as kt

WORKERS, PROCS_PER_WORKER = 2, 2


def train(steps: int = 5, lr: float = 0.1) -> dict:
    """Runs on every rank; ktlite has set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, ..."""
    import hashlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")  # reads the env ktlite set: no arguments needed
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    # synthetic regression data, a different shard per rank
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(64, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=gen)

    loss = torch.tensor(0.0)
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}", flush=True)

    weights = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    return {
        "rank": rank,
        "world_size": world_size,
        "final_loss": round(loss.item(), 6),
        "checksum": hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16],
        "weight_sum": float(weights.sum()),
    }


def main() -> None:
    compute = kt.Compute(cpus=2, memory="1Gi").distribute(
        "pytorch", workers=WORKERS, num_proc=PROCS_PER_WORKER
    )
    remote = kt.fn(train, name="ddp-train").to(compute)  # pods: ddp-train-0, ddp-train-1
    try:
        results = remote(steps=5)  # a list: results[r] came from RANK r
        for r in results:
            print(
                f"rank {r['rank']}/{r['world_size']}: final loss {r['final_loss']:.4f}, "
                f"weights sha256 {r['checksum']} (sum {r['weight_sum']:.6f})"
            )
        assert [r["rank"] for r in results] == list(range(WORKERS * PROCS_PER_WORKER))
        checksums = {r["checksum"] for r in results}
        assert len(checksums) == 1, f"ranks ended with different weights: {checksums}"
        print(f"OK: identical weights on all {len(results)} ranks")
    finally:
        remote.teardown()


if __name__ == "__main__":
    main()
