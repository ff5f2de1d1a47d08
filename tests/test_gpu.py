"""The GPU paths, on a real GPU: skipped where torch sees no CUDA device (``bench/gpu_check.sh``
runs them on a GPU machine and prints one table).

Local backend, real pod servers and rank processes: ``gpus=1`` gives the rank its
``CUDA_VISIBLE_DEVICES`` and a working ``torch.cuda``; ``num_proc=P`` with ``gpus=P`` binds
one device per local rank; NCCL's ``init_process_group`` and ``all_reduce`` (world size 1 on
one GPU, called twice: the group is re-used); a CUDA tensor a rank returns reaches the caller
on its device, and on the CPU in a caller without CUDA (torch's CUDA check answers False
there, the one thing simulated); arguments and results over the shared-memory path as CUDA
tensors; ``status()`` shows the rank's GPU memory and utilisation (NVML where the pod has
``pynvml``, else ``nvidia-smi``); a DDP training step over NCCL.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

import ktlite as kt
from ktlite.backends.local_pods import visible_gpus

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _needs_cuda(torch) -> None:
    # asked when the module's first test starts, not when the suite is collected: collecting
    # would cost every xdist worker a torch import (conftest's `torch` skips without torch)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


MIB = 1 << 20


def cuda_env() -> dict[str, Any]:
    import os

    import torch as t

    x = t.arange(1000, dtype=t.float32, device="cuda")
    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "count": t.cuda.device_count(),
        "name": t.cuda.get_device_name(0),
        "sum": float((x * 2).sum().item()),
        "local_rank": int(os.environ["LOCAL_RANK"]),
    }


def test_one_gpu_gives_the_rank_its_device_and_a_working_cuda() -> None:
    remote = kt.fn(cuda_env, name="gpu-one").to(kt.Compute(cpus=1, gpus=1))
    try:
        out = remote()
    finally:
        remote.teardown()
    assert out["visible"] == visible_gpus()[0]
    assert out["count"] == 1
    assert out["sum"] == 999_000.0


def test_num_proc_ranks_get_one_device_each() -> None:
    procs = min(len(visible_gpus()), 4)
    compute = kt.Compute(cpus=procs, gpus=procs).distribute("pytorch", workers=1, num_proc=procs)
    remote = kt.fn(cuda_env, name="gpu-procs").to(compute)
    try:
        out = remote()
    finally:
        remote.teardown()
    assert [r["local_rank"] for r in out] == list(range(procs))
    assert [r["visible"] for r in out] == visible_gpus()[:procs]  # one each, in order
    assert all(r["count"] == 1 and r["sum"] == 999_000.0 for r in out)


def nccl_all_reduce() -> dict[str, Any]:
    import torch as t
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    x = t.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    t.cuda.synchronize()
    return {"backend": dist.get_backend(), "world": dist.get_world_size(), "sum": x.tolist()}


def test_nccl_all_reduce_twice_on_one_gpu() -> None:
    compute = kt.Compute(cpus=1, gpus=1).distribute("pytorch", workers=1)
    remote = kt.fn(nccl_all_reduce, name="gpu-nccl").to(compute)
    try:
        first, second = remote(), remote()
    finally:
        remote.teardown()
    for out in (first, second):
        assert out == [{"backend": "nccl", "world": 1, "sum": [1.0] * 4}]


def cuda_tensors(scale: float, arg: Any = None) -> dict[str, Any]:
    import torch as t

    g = t.Generator(device="cuda").manual_seed(7)
    weight = t.nn.Parameter(t.randn(16, 16, device="cuda", generator=g))
    out: dict[str, Any] = {
        "plain": t.arange(8, dtype=t.float32, device="cuda") * scale,
        "bf16": t.ones(4, 4, dtype=t.bfloat16, device="cuda"),
        "strided": t.arange(16, device="cuda").reshape(4, 4).t(),
        "param": weight,
        "sparse": t.arange(4.0, device="cuda").to_sparse(),
        # torch pickles a storage itself (torch.save inside): the fallback path on a CPU caller
        "storage": t.arange(3, dtype=t.float32, device="cuda").storage(),
    }
    if arg is not None:
        out["arg_device"] = str(arg.device)
        out["echo"] = arg * 2
    return out


@pytest.fixture(scope="module")
def tensors_remote():
    remote = kt.fn(cuda_tensors, name="gpu-tensors").to(kt.Compute(cpus=1, gpus=1))
    yield remote
    remote.teardown()


def _check_values(out: dict[str, Any], device: str) -> None:
    import torch

    assert out["plain"].device.type == device
    assert out["plain"].cpu().tolist() == [3.0 * i for i in range(8)]
    assert out["bf16"].dtype == torch.bfloat16 and out["bf16"].float().sum().item() == 16.0
    assert out["strided"].cpu().tolist() == torch.arange(16).reshape(4, 4).t().tolist()
    assert isinstance(out["param"], torch.nn.Parameter) and out["param"].requires_grad
    assert out["param"].shape == (16, 16) and out["param"].device.type == device
    assert out["sparse"].is_sparse and out["sparse"].device.type == device
    assert out["sparse"].to_dense().cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out["storage"].device.type == device and out["storage"].tolist() == [0.0, 1.0, 2.0]


def test_a_rank_cuda_tensor_lands_on_the_caller_device(tensors_remote) -> None:
    out = tensors_remote(3.0)
    _check_values(out, "cuda")


def test_a_caller_without_cuda_gets_the_tensors_on_the_cpu(
    tensors_remote, monkeypatch, caplog, torch
) -> None:
    from ktlite_wire import codec

    # A laptop calling a GPU cluster: its torch has no CUDA. Here torch's own check says so
    # (the rank is a real GPU process; the caller's process is this one).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(codec, "_warned_cpu", set())
    with caplog.at_level(logging.WARNING, logger="ktlite_wire.codec"):
        out = tensors_remote(3.0)
    _check_values(out, "cpu")  # the storage: torch's own pickle, loaded again on the CPU
    assert "it is on the CPU" in caplog.text


def test_cuda_arguments_and_results_over_shared_memory(tensors_remote, torch) -> None:
    big = torch.arange(16 * MIB // 4, dtype=torch.float32, device="cuda")  # 16 MB: a file
    out = tensors_remote(3.0, big)
    assert out["arg_device"] == "cuda:0"
    assert out["echo"].device.type == "cuda"
    assert torch.equal(out["echo"], big * 2)


class GpuHolder:
    def __init__(self) -> None:
        self.held: Any = None

    def hold(self, mib: int) -> int:
        import torch as t

        self.held = t.empty(mib * MIB, dtype=t.uint8, device="cuda")
        t.cuda.synchronize()
        return int(t.cuda.memory_allocated())


def _has_pynvml() -> bool:
    import importlib.util

    return importlib.util.find_spec("pynvml") is not None


def test_status_shows_the_rank_gpu_memory_and_utilisation() -> None:
    remote = kt.cls(GpuHolder, name="gpu-status").to(kt.Compute(cpus=1, gpus=1))
    try:
        assert remote.hold(512) >= 512 * MIB
        (pod,) = remote.status()
    finally:
        remote.teardown()
    assert pod.get("gpu_error") is None
    assert pod["gpu_source"] == ("nvml" if _has_pynvml() else "nvidia-smi")
    (rank,) = pod["ranks"]
    assert rank["gpu_memory_total_bytes"] > rank["gpu_memory_used_bytes"] >= 512 * MIB
    assert rank["gpu_utilization_percent"] is not None
    assert len(rank["gpus"]) == 1
    # NVML or nvidia-smi names the rank's own process with what it holds (in a container
    # whose pid namespace differs from the driver's, this is None: not the case here)
    assert rank["gpu_process_memory_bytes"] >= 512 * MIB


def ddp_step(steps: int) -> dict[str, Any]:
    import torch as t
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl")
    t.manual_seed(0)
    model = DDP(t.nn.Sequential(t.nn.Linear(64, 256), t.nn.ReLU(), t.nn.Linear(256, 1)).cuda())
    opt = t.optim.SGD(model.parameters(), lr=0.01)
    x = t.randn(512, 64, device="cuda")
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = t.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"first": losses[0], "last": losses[-1], "device": str(x.device)}


def test_ddp_training_steps_over_nccl() -> None:
    compute = kt.Compute(cpus=1, gpus=1).distribute("pytorch", workers=1)
    remote = kt.fn(ddp_step, name="gpu-ddp").to(compute)
    try:
        (out,) = remote(20)
    finally:
        remote.teardown()
    assert out["device"] == "cuda:0"
    assert out["last"] < out["first"]
