"""The autoscaler of a detached local deployment, in a process of its own (started by
``.to(detached=True)`` and ``ktlite deploy`` as ``python -m ktlite.commands.supervisor NAME``)."""

from __future__ import annotations

import logging
import signal
import sys

from ktlite.api.compute import Compute
from ktlite.backends.local import LocalBackend
from ktlite.modes.deploy import Deployment
from ktlite.modes.routing import Routing
from ktlite.specs.autoscaling import AutoscaleConfig
from ktlite.specs.deployment_spec import DeploymentSpec

logger = logging.getLogger(
    "ktlite.commands.supervisor"
)  # not __name__: this module also runs as __main__


def supervise(name: str) -> int:
    """Scale the detached deployment ``name`` on the replicas' own counts of running calls and
    the calls waiting in clients, so it shrinks (and goes to zero) with no client running;
    returns once the deployment is torn down."""
    backend = LocalBackend.shared()
    applied = backend.lookup(name)
    if applied is None or applied.autoscale is None:
        logger.error("no autoscaled local deployment %r", name)
        return 1
    spec = DeploymentSpec(
        name, Compute(autoscaling=AutoscaleConfig(**applied.autoscale)).pod_spec(), detached=True
    )
    dep = Deployment(spec, backend, applied)
    mode = dep.mode
    if not isinstance(mode, Routing):  # mode_for(spec) with spec.autoscale set
        raise TypeError(f"{name!r}: expected replica routing, got {type(mode).__name__}")
    # teardown sends SIGTERM: the scaling step under way ends first (it may be starting pods)
    signal.signal(signal.SIGTERM, lambda *_: mode.scaler.stop())
    mode.adopt()
    while not mode.scaler.stopped(1.0):
        pass
    mode.scaler.join(spec.pod.calls.launch_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1]))
