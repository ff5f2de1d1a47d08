"""A Monarch mesh on ktlite pods: one controller drives trainer actors on 2 pods x 2 procs.

Run from the repository root (needs torchmonarch here: pip install -e ".[monarch]"):

    python examples/monarch_mesh.py

Every pod's server runs Monarch's worker loop; the class below is built on pod 0, the
controller, which spawns a proc mesh over every pod (``ktlite.distributed.monarch_procs``)
and an actor on each proc. Each step the controller asks every trainer for its gradient on
its own shard of the data, averages them itself and sends the average back: data-parallel
SGD with the controller as the all-reduce. The class keeps its actors between calls. With
backend="kubernetes" and an image holding torchmonarch, the same code runs across pods by
their IPs.
"""

from __future__ import annotations

import time

import ktlite as kt


class Controller:
    """Lives on pod 0; its trainers live on every proc of every pod."""

    def __init__(self, features: int = 8) -> None:
        from monarch.actor import Actor, current_rank, endpoint

        from ktlite.distributed import monarch_procs

        class Trainer(Actor):
            def __init__(self, features: int) -> None:
                import os
                import socket

                import torch

                rank = current_rank().rank
                gen = torch.Generator().manual_seed(rank)
                self.x = torch.randn(256, features, generator=gen)  # this proc's shard
                true_w = torch.arange(features, dtype=torch.float32)
                self.y = self.x @ true_w + 0.01 * torch.randn(256, generator=gen)
                self.w = torch.zeros(features, requires_grad=True)
                self.where = f"{socket.gethostname()} pid {os.getpid()}"

            @endpoint
            def grad(self) -> tuple[list[float], float]:
                self.w.grad = None
                loss = ((self.x @ self.w - self.y) ** 2).mean()
                loss.backward()
                return self.w.grad.tolist(), loss.item()

            @endpoint
            def apply(self, grad: list[float], lr: float) -> None:
                import torch

                with torch.no_grad():
                    self.w -= lr * torch.tensor(grad)

            @endpoint
            def host(self) -> str:
                return self.where

        self.procs = monarch_procs()  # per_host={"gpus": num_proc} on every pod
        self.trainers = self.procs.spawn("trainers", Trainer, features)

    def where(self) -> list[str]:
        return [f"{dict(point)}: {host}" for point, host in self.trainers.host.call().get().items()]

    def train(self, steps: int, lr: float = 0.05) -> list[float]:
        losses = []
        for _ in range(steps):
            answers = [value for _, value in self.trainers.grad.call().get().items()]
            mean = [sum(g[i] for g, _ in answers) / len(answers) for i in range(len(answers[0][0]))]
            self.trainers.apply.call(mean, lr).get()  # the same update on every replica
            losses.append(sum(loss for _, loss in answers) / len(answers))
        return losses


def main() -> None:
    compute = kt.Compute(cpus=1).distribute("monarch", workers=2, num_proc=2)
    t0 = time.perf_counter()
    controller = kt.cls(Controller).to(compute)
    print(f"mesh of 2 pods formed, controller built in {time.perf_counter() - t0:.1f}s")
    try:
        for line in controller.where():
            print("trainer", line)
        t0 = time.perf_counter()
        first = controller.train(20)
        more = controller.train(20)  # the same actors: training goes on
        print(
            f"40 steps in {time.perf_counter() - t0:.2f}s; loss {first[0]:.3f} -> {first[-1]:.3f} "
            f"-> {more[-1]:.4f}"
        )
        assert more[-1] < first[0] / 10, (first, more)
        head = controller.status()[0]["engine"]
        print(
            f"worker loops reachable: {sum(h['reachable'] for h in head['hosts'])} of {len(head['hosts'])}"
        )
        print("OK")
    finally:
        controller.teardown()


if __name__ == "__main__":
    main()
