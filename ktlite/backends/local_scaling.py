"""Autoscaled deployments on the local backend: ktlite's autoscaler runs in the callers.

One calling process leads (it holds the deployment's ``autoscaler.lock``) and scales; the
others route calls and publish how many wait in them. A detached deployment gets a process
of its own (``ktlite.commands.supervisor``). The current launch is kept as ``launch.msg`` (the
Launch message as ``ktlite_wire`` encodes it: a JSON header, the code in opaque buffers) for
replicas started later, its generation (one per ``.to()``) counted in ``launch.generation``.
The files live in the deployment's directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ktlite.backends.base import Applied
from ktlite.backends.processes import pid_alive
from ktlite.errors import DeployError, NotDeployedError
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire import privatefiles
from ktlite_wire.launch import Launch

# the current launch, which replicas started later load (KTLITE_LAUNCH_FILE): the Launch
# message as ktlite_wire encodes it, not a pickle
LAUNCH_FILE = "launch.msg"


class LocalScaling:
    """The local backend's :class:`~ktlite.backends.capabilities.Serving` and
    :class:`~ktlite.backends.capabilities.ClientScaling` (mixed into it)."""

    _leads: dict[str, int]  # deployment -> the fd of the autoscaler lock this process holds
    _lock: threading.RLock

    if TYPE_CHECKING:  # the local backend's, which this is mixed into

        def _dir(self, name: str) -> Path: ...
        def _read(self, name: str) -> dict[str, Any] | None: ...
        def apply(self, spec: DeploymentSpec, token: str) -> Applied: ...

    def autoscaler(self, spec: DeploymentSpec) -> str:
        return "client"

    def write_launch(self, name: str, launch: Launch) -> Launch:
        """``launch.msg`` in the deployment's directory (0600), which replicas load at boot,
        as the next generation (counted in ``launch.generation``, under ``launch.lock``: every
        process that deploys ``name`` takes its generation from there)."""
        directory = self._dir(name)
        privatefiles.make_dir(directory)
        with _locked(directory / "launch.lock", f"the launch of {name!r}"):
            counter = directory / "launch.generation"
            try:
                generation = int(counter.read_text() or 0) + 1
            except FileNotFoundError:
                generation = 1
            # the count first: a launch file is never newer than the count (a write cut
            # between the two costs a generation, never gives one out twice)
            privatefiles.write_file(counter, str(generation))
            stamped = replace(launch, generation=generation)
            privatefiles.write_file(directory / LAUNCH_FILE, stamped.encode())
        return stamped

    def lead_scaling(self, name: str) -> bool:
        """Whether this process holds the deployment's autoscaler lock (taken once, kept until
        it exits); one process scales a local deployment, the others route."""
        path = self._dir(name) / "autoscaler.lock"
        if name in self._leads:
            with contextlib.suppress(
                OSError
            ):  # still the lock of this deployment, not a torn-down one's
                if os.fstat(self._leads[name]).st_ino == os.stat(path).st_ino:
                    return True
            os.close(self._leads.pop(name))
        try:
            fd = os.open(path, _LOCK_FLAGS, privatefiles.FILE_MODE)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._leads[name] = fd
        return True

    def scale(self, name: str, token: str, replicas: int) -> Applied:
        """Run ``replicas`` replicas of the autoscaled deployment ``name``, as it was deployed
        (its spec is kept in its directory: a process that attached by name has no Compute)."""
        with self._lock:  # never after a teardown of this process (it takes the same lock)
            try:
                with open(self._dir(name) / "spec.pkl", "rb") as f:
                    spec = pickle.load(f)
            except (OSError, pickle.UnpicklingError, EOFError) as e:
                raise NotDeployedError(
                    f"deployment {name!r} is not running here (or was torn down): {e}"
                ) from None
            if (self._read(name) or {}).get("token") != token:
                raise NotDeployedError(f"deployment {name!r} was torn down or re-created")
            return self.apply(replace(spec, replicas=replicas), token)

    def publish_waiting(self, name: str, count: int) -> None:
        """The calls waiting for a replica in this process, for the process that scales."""
        directory = self._dir(name) / "waiting"
        with contextlib.suppress(OSError):
            privatefiles.make_dir(directory)
            privatefiles.write_file(directory / str(os.getpid()), str(count))

    def waiting_elsewhere(self, name: str) -> int:
        """The calls waiting in the other live processes that call ``name``."""
        total = 0
        with contextlib.suppress(OSError):
            for f in (self._dir(name) / "waiting").iterdir():
                if f.name.isdigit() and int(f.name) != os.getpid() and pid_alive(int(f.name)):
                    with contextlib.suppress(OSError, ValueError):
                        total += int(f.read_text() or 0)
        return total

    def supervise(self, name: str) -> None:
        """Start the autoscaler process of a detached deployment (ktlite.commands.supervisor.supervise)."""
        log = self._dir(name) / "autoscaler.log"
        with privatefiles.open_append(log) as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ktlite.commands.supervisor", name],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self._dir(name),
            )  # not the caller's: see apply()
        # teardown stops it first
        privatefiles.write_file(self._dir(name) / "supervisor.pid", str(proc.pid))

    def _stop_supervisor(self, name: str, timeout: float) -> None:
        """Stop a detached deployment's autoscaler process before its pods: it ends the scaling
        step it is in (it would start pods again), then exits."""
        try:
            pid = int((self._dir(name) / "supervisor.pid").read_text())
        except (OSError, ValueError):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def record_scaling(self, name: str, info: dict[str, Any]) -> None:
        """The autoscaler's last decision, for `ktlite status` in another process."""
        directory = self._dir(name)
        if directory.is_dir():
            privatefiles.write_file(
                directory / "autoscaler.json",
                json.dumps({**info, "pid": os.getpid()}, default=str),
            )

    def scaling_status(self, name: str) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = json.loads((self._dir(name) / "autoscaler.json").read_text())
        except (OSError, ValueError):
            return None
        info["alive"] = pid_alive(info.get("pid"))  # the process whose autoscaler decided it
        return info


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC  # a lock file: 0600
LOCK_TIMEOUT_S = 30.0  # a launch write holds the lock for two small file writes


@contextlib.contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (another process writing ``what`` waits)."""
    fd = os.open(path, _LOCK_FLAGS, privatefiles.FILE_MODE)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DeployError(
                        f"{path} stayed locked for {LOCK_TIMEOUT_S:g}s while writing {what}: "
                        "another process holds it (a .to() of the same deployment that hangs?); "
                        "end that process, or delete the lock file if none runs, and try again"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock
