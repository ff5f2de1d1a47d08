"""MiniRay's FSDP example in ktlite form: a trainer class on 2 SSH hosts x 2 processes each.

    python examples/ssh_cluster.py gpu1 gpu2            # two of your machines (ssh aliases)
    python examples/ssh_cluster.py                      # two local sshd "hosts" (root, Debian)

Each host runs one ktlite pod server, started over SSH (nothing installed there but
Python); each pod runs 2 rank processes with the torchrun environment. The class is built on
every rank (FSDP over gloo on CPU here; NCCL on GPUs), and this process is MiniRay's
coordinator: every step it calls ``forward_backward`` on all ranks at once, then
``optim_step``, and prints the loss, the gradient norm and the learning rate. Without
arguments it starts two real OpenSSH servers on loopback addresses (tests/ssh_hosts.py) and
uses them as the hosts.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

import ktlite as kt


class Trainer:
    """One rank of the model: FSDP shards its parameters over every rank of every host."""

    def __init__(self, lr: float = 0.2) -> None:
        import os

        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        self.rank = dist.get_rank()
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.manual_seed(0)  # the same initial weights everywhere
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=5, gamma=0.5)
        gen = torch.Generator().manual_seed(1000 + self.rank)  # this rank's shard of the data
        self.x = torch.randn(256, 16, generator=gen)
        self.y = self.x.sum(dim=1, keepdim=True) * 0.5

    def forward_backward(self, step: int) -> dict:
        import torch

        batch = slice((step * 32) % 256, (step * 32) % 256 + 32)
        loss = torch.nn.functional.mse_loss(self.model(self.x[batch]), self.y[batch])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)
        return {
            "loss": loss.item(),
            "grad_norm": float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm),
        }

    def optim_step(self) -> float:
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        return self.sched.get_last_lr()[0]


def main(hosts: kt.Hosts) -> None:
    t0 = time.perf_counter()
    trainer = kt.cls(Trainer).to(kt.Compute(hosts=hosts).distribute("pytorch", num_proc=2))
    print(f"2 hosts x 2 processes up, model sharded, in {time.perf_counter() - t0:.1f}s")
    try:
        first = None
        for step in range(12):
            outs = trainer.forward_backward(step)  # one dict per rank, in rank order
            lr = trainer.optim_step()[0]
            loss = sum(o["loss"] for o in outs) / len(outs)
            first = first if first is not None else loss
            print(
                f"step {step:2d}  loss {loss:.4f}  grad norm {outs[0]['grad_norm']:.3f}  lr {lr:.3f}"
            )
        assert loss < first, (first, loss)
        print("OK")
    finally:
        trainer.teardown()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(kt.Hosts(sys.argv[1:]))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from ssh_hosts import SshHosts

        with contextlib.ExitStack() as stack:
            local = stack.enter_context(
                SshHosts(Path(tempfile.mkdtemp(prefix="ktlite-ssh-example-")), 2)
            )
            print(
                "hosts:", ", ".join(f"{h.name} = sshd at {h.address}:{h.port}" for h in local.hosts)
            )
            main(
                kt.Hosts(
                    [h.name for h in local.hosts],
                    ssh_config=str(local.ssh_config),
                    known_hosts=str(local.known_hosts),
                    python=sys.executable,
                )
            )
