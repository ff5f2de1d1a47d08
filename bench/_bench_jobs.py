"""What ``bench.py`` runs on its deployments (a local module: ktlite ships it by value, as it
ships ``_torchrun_job.allreduce_job``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

XFER_BYTES = 100 * 1_000_000


def noop() -> None:
    return None


_HELD: dict[str, Any] = {}  # filled on the rank only: each result array is built once, then reused


def array(kind: str) -> Any:
    """A float32 numpy array or torch tensor of XFER_BYTES."""
    if kind == "numpy":
        import numpy

        return numpy.ones(XFER_BYTES // 4, dtype=numpy.float32)
    import torch

    return torch.ones(XFER_BYTES // 4, dtype=torch.float32)


def xfer(x: Any = None, kind: str | None = None) -> Any:
    """With ``x``: take an argument and return None. With ``kind``: return a held 100 MB array."""
    if kind is None:
        return None
    if kind not in _HELD:
        _HELD[kind] = array(kind)
    return _HELD[kind]


def versioned(version: int) -> Callable[[], int]:
    """A function named ``bench_redeploy`` whose body returns ``version``: an edited function."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(
        compile(f"def bench_redeploy():\n    return {version}\n", "<bench-edit>", "exec"), namespace
    )
    fn: Callable[[], int] = namespace["bench_redeploy"]
    return fn
