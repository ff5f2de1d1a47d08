"""ktlite on a GPU machine: the GPU tests and a few measurements, as one table.

    bash bench/gpu_check.sh              # on a machine with CUDA (see that script)
    python bench/gpu_check.py --json out.json

Part 1 runs ``tests/test_gpu.py`` (its tests skip without CUDA) and lists each test with
pass / fail / skip. Part 2 measures, local backend, one pod with ``gpus=1``:

- cold ``.to()`` of a 1-GPU pod, then a warm no-op call (p50/p99 of 200);
- a small DDP training step over NCCL (world size 1): the per-step time inside the rank
  against the same function run in a plain process on the same GPU (``torch.distributed``
  set up by hand): ktlite must add nothing to a step;
- a 256 MB CUDA tensor from the rank to the caller, and back as an argument: over the
  shared-memory files (the local default) and over HTTP (``KTLITE_SHM=0``, the Kubernetes
  and SSH path), in GB/s (10^9 bytes); a CPU tensor of the same size beside it, so that the
  device copies and the transport can be told apart;
- NCCL ``all_reduce`` of 256 MB on one GPU, for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
os.environ.setdefault("KTLITE_HOME", tempfile.mkdtemp(prefix="ktlite-gpu-check-"))

import ktlite as kt  # noqa: E402

MB = 10**6
SIZE = 256 * MB


def run_tests(out_dir: Path) -> list[tuple[str, str, str]]:
    """(test, outcome, first line of its failure) for each test of tests/test_gpu.py."""
    xml = out_dir / "gpu-tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(ROOT / "tests" / "test_gpu.py"),
        "-o",
        "addopts=",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:warnings",  # another machine's torch and Python warn differently: not a failure here
        "-q",
        "-rA",
        f"--junitxml={xml}",
    ]
    with open(out_dir / "gpu-tests.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    if not xml.exists():
        tail = (out_dir / "gpu-tests.log").read_text()[-300:].replace("\n", " | ")
        return [("pytest tests/test_gpu.py", "ERROR", tail)]
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, why = "pass", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAIL", "error": "ERROR", "skipped": "skip"}[tag]
                why = (
                    (node.get("message") or "").splitlines()[0][:90] if node.get("message") else ""
                )
        rows.append((case.get("name", "?"), outcome, why))
    return rows


def noop() -> None:
    return None


def ddp_steps(steps: int, warmup: int) -> dict[str, Any]:
    """DDP over NCCL, world size from the environment; the mean step time after warm-up."""
    import time as _time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    width = 2048
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)
        ).cuda()
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, width, device="cuda")
    times = []
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = _time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(_time.perf_counter() - t0)
    return {"step_ms": 1e3 * sum(times) / len(times), "loss": float(loss.item())}


def blob(nbytes: int, device: str) -> Any:
    import torch

    return torch.ones(nbytes // 4, dtype=torch.float32, device=device)


def total(t: Any) -> float:
    return float(t.sum().item())


def all_reduce_ms(nbytes: int, iters: int) -> float:
    import time as _time

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl")
    x = torch.ones(nbytes // 4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = _time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    return 1e3 * (_time.perf_counter() - t0) / iters


def _plain_ddp(steps: int, warmup: int) -> dict[str, Any]:
    """The same DDP function in a plain Python process (no ktlite), world size 1."""
    code = (
        "import json, os, sys\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29533', RANK='0', "
        "WORLD_SIZE='1', LOCAL_RANK='0')\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import gpu_check\n"
        f"print(json.dumps(gpu_check.ddp_steps({steps}, {warmup})))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KTLITE_HOME"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"plain DDP process failed: {proc.stderr.strip()[-400:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _gbps(seconds: float) -> float:
    return SIZE / seconds / 1e9


def _transfers(remote: Any, label: str, rows: list[tuple[str, str]]) -> None:
    for device in ("cuda", "cpu"):  # the CPU tensor: the transport alone, for comparison
        best_down = best_up = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            t = remote.call_blob(SIZE, device)
            best_down = min(best_down, time.perf_counter() - t0)
            t0 = time.perf_counter()
            remote.call_sum(t)
            best_up = min(best_up, time.perf_counter() - t0)
        name = f"256 MB {device.upper()} tensor"
        rows.append((f"{name} rank -> caller, {label}", f"{_gbps(best_down):.2f} GB/s"))
        rows.append((f"{name} caller -> rank, {label}", f"{_gbps(best_up):.2f} GB/s"))


class Probe:
    """One deployment that does every measured thing (a class: one warm pod)."""

    def noop(self) -> None:
        return None

    def call_blob(self, nbytes: int, device: str) -> Any:
        return blob(nbytes, device)

    def call_sum(self, t: Any) -> float:
        return total(t)

    def ddp(self, steps: int, warmup: int) -> dict[str, Any]:
        return ddp_steps(steps, warmup)

    def all_reduce(self, nbytes: int, iters: int) -> float:
        return all_reduce_ms(nbytes, iters)


def measure(steps: int) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    compute = kt.Compute(cpus=2, gpus=1).distribute("pytorch", workers=1)
    t0 = time.perf_counter()
    remote = kt.cls(Probe, name="gpu-check").to(compute)
    rows.append(("cold .to(), 1 pod with gpus=1", f"{time.perf_counter() - t0:.2f} s"))
    try:
        times = []
        for i in range(220):
            t0 = time.perf_counter()
            remote.noop()
            if i >= 20:
                times.append(time.perf_counter() - t0)
        times.sort()
        rows.append(
            (
                "warm no-op call p50 / p99",
                f"{1e3 * statistics.median(times):.2f} / {1e3 * times[int(0.99 * len(times))]:.2f} ms",
            )
        )
        (inside,) = remote.ddp(steps, 5)
        plain = _plain_ddp(steps, 5)
        rows.append(
            (
                f"DDP step (2x Linear 2048, batch 256, AdamW), mean of {steps}",
                f"{inside['step_ms']:.2f} ms in ktlite, {plain['step_ms']:.2f} ms plain "
                f"({inside['step_ms'] / plain['step_ms']:.2f}x)",
            )
        )
        (pod,) = remote.status()
        (rank,) = pod["ranks"]
        rows.append(
            (
                f"status(): GPU read through {pod['gpu_source']}",
                f"rank holds {(rank['gpu_process_memory_bytes'] or 0) / 2**20:.0f} MiB of "
                f"{(rank['gpu_memory_used_bytes'] or 0) / 2**20:.0f} used / "
                f"{(rank['gpu_memory_total_bytes'] or 0) / 2**30:.0f} GiB, "
                f"utilisation {rank['gpu_utilization_percent']}%",
            )
        )
        (ms,) = remote.all_reduce(SIZE, 20)
        rows.append(("NCCL all_reduce 256 MB, world 1", f"{ms:.2f} ms"))
        _transfers(_Each(remote), "shared-memory files", rows)
        os.environ["KTLITE_SHM"] = "0"  # read at each call
        try:
            _transfers(_Each(remote), "HTTP (KTLITE_SHM=0)", rows)
        finally:
            os.environ.pop("KTLITE_SHM")
    finally:
        remote.teardown()
    return rows


class _Each:
    """A distributed class's methods return one value per rank: this one's single value."""

    def __init__(self, remote: Any) -> None:
        self.remote = remote

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.remote, name)
        return lambda *a: method(*a)[0]


def gpu_line() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        out = f"nvidia-smi: {e}"
    import torch

    return f"{out}; torch {torch.__version__} (CUDA {torch.version.cuda}); Python {sys.version.split()[0]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp())
    ap.add_argument("--json", help="also write the table here")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"GPU: {gpu_line()}", flush=True)
    tests = [] if args.skip_tests else run_tests(out_dir)
    try:
        rows = measure(args.steps)
    except Exception as e:  # the table still prints the tests
        rows = [("measurements", f"FAILED: {type(e).__name__}: {str(e)[:300]}")]
    width = max([len(t[0]) for t in tests] + [len(r[0]) for r in rows] + [10])
    print(f"\n{'tests/test_gpu.py':<{width}}  outcome")
    for name, outcome, why in tests:
        print(f"{name:<{width}}  {outcome}{'  ' + why if why else ''}")
    print(f"\n{'measurement':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"gpu": gpu_line(), "tests": tests, "rows": rows}, indent=1)
        )
    failed = [t for t in tests if t[1] in ("FAIL", "ERROR")]
    return 1 if failed or any("FAILED" in v for _, v in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
