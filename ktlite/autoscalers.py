"""Where ktlite's own autoscaler runs, and how it ends.

- In every process that calls a local autoscaled deployment, a scaling thread
  (:class:`ktlite.serving.ServingDeployment`). At interpreter exit these threads are stopped
  first, before the local backend tears the process's deployments down and before the
  shared HTTP client closes; a step under way gets ``EXIT_JOIN_S`` to end. (A thread left
  running there sent its next request on the closed client and printed ``scaling:
  RuntimeError: Cannot send a request, as the client has been closed``.)
- For a detached local deployment, a process of its own (:func:`supervise`, started as
  ``python -m ktlite.autoscalers NAME``), so the deployment scales with no client running.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ktlite.serving import ServingDeployment

logger = logging.getLogger("ktlite.autoscalers")  # not __name__: this module also runs as __main__
EXIT_JOIN_S = 5.0

_running: weakref.WeakSet[ServingDeployment] = weakref.WeakSet()
_hook = threading.Lock()  # held once the exit hook is registered


def track(dep: ServingDeployment) -> None:
    """Stop ``dep``'s scaling thread at exit. Called as the thread starts: after its backend
    and its HTTP client registered their own exit handlers, which atexit then runs after
    this one (it runs the last registered first)."""
    if _hook.acquire(blocking=False):
        atexit.register(stop_all)
    _running.add(dep)


def stop_all() -> None:
    """Stop every tracked scaling thread and wait up to ``EXIT_JOIN_S`` for them to end."""
    deps = list(_running)
    for dep in deps:
        dep._stop.set()
        dep._wake.set()
    deadline = time.monotonic() + EXIT_JOIN_S
    for dep in deps:
        if dep._thread is not None:
            dep._thread.join(max(0.0, deadline - time.monotonic()))


def supervise(name: str) -> int:
    """The autoscaler of a detached local deployment, in a process of its own (started by
    ``.to(detached=True)`` and ``ktlite deploy``): it scales on the replicas' own counts of
    running calls and the calls waiting in clients, so the deployment shrinks (and goes to
    zero) with no client running; it exits once the deployment is torn down."""
    from ktlite.autoscaling import AutoscaleConfig
    from ktlite.backends.local import LocalBackend
    from ktlite.compute import Compute
    from ktlite.serving import ServingDeployment
    from ktlite.spec import DeploymentSpec

    backend = LocalBackend.shared()
    applied = backend.lookup(name)
    if applied is None or applied.autoscale is None:
        logger.error("no autoscaled local deployment %r", name)
        return 1
    spec = DeploymentSpec(
        name, Compute(autoscaling=AutoscaleConfig(**applied.autoscale)), detached=True
    )
    dep = ServingDeployment(spec, backend, applied)
    # teardown sends SIGTERM: the scaling step under way ends first (it may be starting pods)
    signal.signal(signal.SIGTERM, lambda *_: dep._stop.set())
    dep.adopt()
    while not dep._stop.wait(1.0):
        pass
    if dep._thread is not None:
        dep._thread.join(spec.compute.launch_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1]))
