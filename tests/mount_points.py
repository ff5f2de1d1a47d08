"""The mount points stand-in clusters (``kube_harness.py``) make on this machine, shared.

A pod's bind mount needs its mount point on this machine's filesystem (a private mount
namespace does not make one), and several stand-in clusters run at once (one per xdist
worker). Removing a directory that is a mount point in another process's mount namespace
silently unmounts it there (Linux 3.18 and later): one cluster's clean-up took
``/var/run/ktlite/token`` from under another cluster's starting pod, whose server then found
no token file. So every cluster registers the directories it made and its own pid here, and
only the last live cluster to stop removes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ktlite.backends.processes import pid_alive

REGISTRY = Path(tempfile.gettempdir()) / "ktlite-harness-mount-points"


class MountPoints:
    def __init__(self, registry: Path = REGISTRY, pid: int | None = None) -> None:
        self.registry = registry
        registry.mkdir(mode=0o700, exist_ok=True)
        self._me = registry / f"{os.getpid() if pid is None else pid}.live"
        with self._locked():
            self._me.touch()

    def make(self, path: Path) -> None:
        """``path`` and its missing parents, registered for removal by the last cluster."""
        with self._locked():
            missing = [p for p in (path, *path.parents) if not p.exists()]
            path.mkdir(parents=True, exist_ok=True)
            if missing:
                with open(self.registry / "dirs", "a") as f:
                    f.writelines(f"{p}\n" for p in missing)

    def release(self) -> None:
        """This cluster stopped. The last live one removes every registered directory, the
        deepest first and only when empty."""
        with self._locked():
            self._me.unlink(missing_ok=True)
            for other in self.registry.glob("*.live"):
                if pid_alive(int(other.stem)):
                    return
                other.unlink(missing_ok=True)  # a cluster that died without releasing
            registered = self.registry / "dirs"
            made = registered.read_text().splitlines() if registered.exists() else []
            for path in sorted(set(made), key=lambda p: -len(Path(p).parts)):
                with contextlib.suppress(OSError):
                    Path(path).rmdir()
            registered.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.registry / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
