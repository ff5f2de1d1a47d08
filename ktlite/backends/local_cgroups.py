"""Memory cgroups of local pods: ``memory_limit`` enforced on this machine as on a cluster."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def memory_cgroup(name: str, limit: int) -> Path | None:
    """A memory cgroup for one local pod, capped at ``limit`` bytes, under this process's
    own (so ``memory_limit`` OOM-kills locally as on a cluster); None where cgroups cannot be
    written (not root, no memory controller, cgroup v2 without delegation)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):  # cgroup v1
            group = Path(f"/sys/fs/cgroup/memory{path.rstrip('/')}") / f"ktlite-{name}"
            limit_file = "memory.limit_in_bytes"
            break
    else:
        unified = next((p for _, c, p in lines if c == ""), None)
        if unified is None:
            return None
        group = Path(f"/sys/fs/cgroup{unified.rstrip('/')}") / f"ktlite-{name}"
        limit_file = "memory.max"
    try:
        group.mkdir(exist_ok=True)
        (group / limit_file).write_text(str(limit))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None
    return group


def remove_cgroup(path: str | None) -> None:
    if not path:
        return
    for _ in range(50):  # the kernel frees a cgroup once its last process is reaped
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
