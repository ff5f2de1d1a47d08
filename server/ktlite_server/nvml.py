"""GPUs read through NVML (``pynvml``, NVIDIA's ``nvidia-ml-py``) where the pod has it: the same
rows ``nvidia-smi``'s queries give (:mod:`ktlite_server.usage`), without starting a process
per status request.

:func:`read` returns None where NVML is not there (no ``pynvml`` module, or no driver library
to load): the caller asks ``nvidia-smi`` then. It blocks (NVML calls into the driver), so it
runs in a thread, under the caller's timeout; a call into a GPU in trouble that never
returns holds that one thread, and :class:`Reader` starts no second one beside it.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

Rows = tuple[list[dict[str, Any]], list[tuple[int, str, int | None]]]


class Unavailable(Exception):
    """NVML cannot be used here: no module, or no driver library."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe(nvml: Any, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or None where this GPU does not support the query."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _open() -> Any:
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as e:
        raise Unavailable(f"no pynvml module ({e})") from None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:  # no libnvidia-ml.so, no driver loaded
        raise Unavailable(f"nvmlInit failed: {e}") from None
    return nvml


def read() -> Rows:
    """Every GPU (index, uuid, name, memory used/total in bytes, utilisation %) and the
    compute processes on them (pid, GPU uuid, bytes). Raises Unavailable."""
    nvml = _open()
    try:
        gpus: list[dict[str, Any]] = []
        apps: list[tuple[int, str, int | None]] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(h))
            memory = _maybe(nvml, nvml.nvmlDeviceGetMemoryInfo, h)
            rates = _maybe(nvml, nvml.nvmlDeviceGetUtilizationRates, h)
            gpus.append(
                {
                    "index": index,
                    "uuid": uuid,
                    "name": _text(nvml.nvmlDeviceGetName(h)),
                    "memory_used_bytes": None if memory is None else int(memory.used),
                    "memory_total_bytes": None if memory is None else int(memory.total),
                    "utilization_percent": None if rates is None else float(rates.gpu),
                }
            )
            for p in _maybe(nvml, nvml.nvmlDeviceGetComputeRunningProcesses, h) or []:
                used = getattr(p, "usedGpuMemory", None)
                apps.append((int(p.pid), uuid, None if used is None else int(used)))
        return gpus, apps
    finally:
        nvml.nvmlShutdown()


class Reader:
    """:func:`read` in a thread, one at a time; ``available`` turns False for good once NVML
    proved missing, so a pod without it asks ``nvidia-smi`` from then on at no cost."""

    def __init__(self) -> None:
        self.available = True
        self._busy = threading.Lock()

    def __call__(self) -> Rows | None:
        """The rows, or None where NVML is missing. Raises RuntimeError while an earlier
        read is still inside the driver, or when NVML fails on a GPU."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("an earlier NVML query has not returned (a GPU in trouble?)")
        try:
            return read()
        except Unavailable:
            self.available = False
            return None
        except Exception as e:  # pynvml's NVMLError subclasses, from a GPU in trouble
            raise RuntimeError(f"NVML query failed: {e}") from None
        finally:
            self._busy.release()
