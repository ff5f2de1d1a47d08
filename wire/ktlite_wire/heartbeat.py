"""A call stream's liveness: how often a pod speaks while a call is quiet, and how long a
reader waits in silence before it takes the pod for gone.

A pod server sends a heartbeat frame every :data:`HEARTBEAT_S` while a call's stream has
nothing else to say. Both readers of such streams, the caller (reading the coordinator pod)
and the coordinator pod (reading the other pods), give up after the silence timeout: a pod
that was killed or stopped (SIGSTOP, a frozen node, a network partition that swallows
packets) is then reported by name instead of leaving the call hanging.

The silence timeout is :data:`DEFAULT_SILENCE_S`, or ``KTLITE_SILENCE_TIMEOUT`` (seconds,
above the heartbeat interval) from the environment of the process that reads: the caller's
for the caller's wait on the coordinator, the pods' (``kt.Compute(env=...)``) for the
coordinator's wait on the other pods. Each process reads it once, when the module that waits
is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

HEARTBEAT_S = 2.0  # a pod's heartbeat interval on a quiet call stream
DEFAULT_SILENCE_S = 10.0  # silence this long (5 heartbeats missed) means the pod is gone
SILENCE_ENV = "KTLITE_SILENCE_TIMEOUT"


def silence_timeout(environ: Mapping[str, str] | None = None) -> float:
    """The silence timeout in seconds: ``KTLITE_SILENCE_TIMEOUT`` from ``environ`` (default
    ``os.environ``) when set and not blank, else :data:`DEFAULT_SILENCE_S`.

    Raises ValueError, naming the variable, its value and what is allowed, for a value that is
    not a finite number above :data:`HEARTBEAT_S` (a shorter silence would fail calls to
    healthy pods between two heartbeats)."""
    raw = (os.environ if environ is None else environ).get(SILENCE_ENV, "")
    if not raw.strip():
        return DEFAULT_SILENCE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > HEARTBEAT_S):
        raise ValueError(
            f"{SILENCE_ENV}={raw!r} is not allowed: it must be a number of seconds above "
            f"{HEARTBEAT_S:g} (pods send a heartbeat every {HEARTBEAT_S:g}s while a call is "
            f"quiet); set it to e.g. {DEFAULT_SILENCE_S:g} (the default), or unset it"
        )
    return value
