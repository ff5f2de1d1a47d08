"""Whether the kernel's OOM killer ended a rank process: the OOM counters of the pod's
memory cgroup, read before and after (best effort: a counter that rose explains one death)."""

from __future__ import annotations

import contextlib
import os


def _files() -> list[str]:
    """The OOM counters of this process's memory cgroup (v2 memory.events, v1
    memory.oom_control), read through /proc/self/cgroup: on a local pod with a memory limit
    that is the pod's own cgroup; in a container, the container's."""
    paths = []
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "":
                paths.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
            elif "memory" in controllers.split(","):
                paths.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control")
    paths += ["/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"]
    return [p for p in dict.fromkeys(paths) if os.path.exists(p)]


def _count(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        for line in f:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def killed() -> bool:
    """Best effort: did the kernel's OOM killer fire in this cgroup since the server started?"""
    for path in _files():
        count = _count(path)
        if count is not None and count > _BASELINE.get(path, 0):
            _BASELINE[path] = count  # one kill explains one death
            return True
    return False


def _read_baseline() -> dict[str, int]:
    return {p: c for p in _files() if (c := _count(p)) is not None}


_BASELINE = _read_baseline()
