"""Processes of this machine: whether one still runs."""

from __future__ import annotations

import contextlib
import os


def pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not reaped) does not; a stopped process does."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        if f.read().rsplit(") ", 1)[-1].startswith(("Z", "X")):
            return False  # a zombie has exited
    return True
