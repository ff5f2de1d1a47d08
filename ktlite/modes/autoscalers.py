"""Where ktlite's own autoscaler runs, and how it ends.

- In every process that calls a local autoscaled deployment, a scaling thread
  (:class:`ktlite.modes.serving.ReplicaScaler`). At interpreter exit these threads are stopped
  first, before the local backend tears the process's deployments down and before the
  shared HTTP client closes; a step under way gets ``EXIT_JOIN_S`` to end. (A thread left
  running there sent its next request on the closed client and printed ``scaling:
  RuntimeError: Cannot send a request, as the client has been closed``.)
- For a detached local deployment, a process of its own (:func:`ktlite.commands.supervisor.supervise`,
  started as ``python -m ktlite.commands.supervisor NAME``), so the deployment scales with no client
  running.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Protocol


class _Scaling(Protocol):
    """A scaling thread (:class:`ktlite.modes.serving.ReplicaScaler`)."""

    def stop(self) -> None: ...

    def join(self, timeout: float) -> None: ...


EXIT_JOIN_S = 5.0

_running: weakref.WeakSet[_Scaling] = weakref.WeakSet()
_hook = threading.Lock()  # held once the exit hook is registered


def track(scaler: _Scaling) -> None:
    """Stop ``scaler``'s thread at exit. Called as the thread starts: after its backend
    and its HTTP client registered their own exit handlers, which atexit then runs after
    this one (it runs the last registered first)."""
    if _hook.acquire(blocking=False):
        atexit.register(stop_all)
    _running.add(scaler)


def stop_all() -> None:
    """Stop every tracked scaling thread and wait up to ``EXIT_JOIN_S`` for them to end."""
    scalers = list(_running)
    for scaler in scalers:
        scaler.stop()
    deadline = time.monotonic() + EXIT_JOIN_S
    for scaler in scalers:
        scaler.join(deadline - time.monotonic())
