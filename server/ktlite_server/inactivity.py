"""The pod server's ``inactivity_ttl``: how long the pod has gone without a call, and what
happens once that is longer than the TTL.

Activity is a request that carries the token, other than ``/health`` (a readiness probe, or a
client asking how idle the pod is, does not keep it alive); a running call keeps the pod
active however long it runs. ``GET /health`` with the token reports ``idle_s`` and
``inactivity_ttl``, which ``ktlite list`` shows and a client's sweep acts on.

When the TTL passes:

- **local and SSH** servers stop (nothing restarts them);
- **on Kubernetes** a stopped server would be restarted by its StatefulSet, so none stops:
  pod 0 (the coordinator: every call, of every mode, arrives there first) deletes the
  deployment's objects through the API (:mod:`ktlite_server.selfteardown`); the other pods
  wait for that. Where the API cannot be reached, or the pod has no token for it, pod 0 says
  so in its log and keeps serving (a pod that exits would only be restarted into the same
  idleness); it tries again every :data:`RETRY_S`, and a client's ``ktlite list`` or
  ``ktlite teardown --expired`` removes the deployment meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ktlite_server.selfteardown import SelfTeardown, TeardownError

if TYPE_CHECKING:
    from ktlite_server.pod import Pod

logger = logging.getLogger(__name__)

RETRY_S = 60.0  # between two attempts at tearing down, once the TTL has passed


def idle_seconds(pod: Pod) -> float:
    """Seconds since the pod's last call or authorized request; 0 while a call runs."""
    return 0.0 if pod.calls else max(0.0, time.monotonic() - pod.last_active)


class Inactivity:
    """Watches one pod's idleness against its ``ttl`` (seconds)."""

    def __init__(
        self,
        ttl: float,
        pod: Pod,
        stop: Callable[[], None],
        *,
        kubernetes: bool = False,
        teardown: SelfTeardown | None = None,
    ) -> None:
        self.ttl = ttl
        self.pod = pod
        self.stop = stop  # stops the server (local and SSH)
        self.kubernetes = kubernetes
        self.teardown = teardown
        self.tearing_down: asyncio.Task[bool] | None = None  # awaited before the server exits
        self._said = False

    async def watch(self) -> None:
        """Until the TTL passes (then act on it); on Kubernetes, until the deployment is gone."""
        while True:
            await asyncio.sleep(min(1.0, self.ttl / 4))
            idle = idle_seconds(self.pod)
            if idle <= self.ttl:
                continue
            if not self.kubernetes:
                logger.warning("no client for %gs (inactivity_ttl): stopping", self.ttl)
                self.stop()
                return
            if self.pod.ordinal != 0:
                return  # pod 0 acts for the deployment; this one waits to be deleted
            if self.teardown is None:
                if not self._said:
                    self._said = True
                    logger.warning(
                        "idle for %.0fs, past inactivity_ttl %gs; this pod has no access to "
                        "the Kubernetes API (the deployment's pods run under a ServiceAccount "
                        "of the user's), so it keeps serving until a client's `ktlite list` or "
                        "`ktlite teardown --expired` removes the deployment",
                        idle,
                        self.ttl,
                    )
                return
            self.tearing_down = asyncio.ensure_future(self._tear_down(idle))
            if await self.tearing_down:
                return
            await asyncio.sleep(RETRY_S)

    async def _tear_down(self, idle: float) -> bool:
        assert self.teardown is not None
        try:
            deleted = await asyncio.to_thread(self.teardown.run)
        except TeardownError as e:
            level = logging.DEBUG if self._said else logging.WARNING
            self._said = True
            logger.log(
                level,
                "idle for %.0fs, past inactivity_ttl %gs, but the deployment could not "
                "delete itself: %s; serving on (trying again every %gs): a client's "
                "`ktlite list` or `ktlite teardown --expired` removes it",
                idle,
                self.ttl,
                e,
                RETRY_S,
            )
            return False
        logger.warning(
            "idle for %.0fs, past inactivity_ttl %gs: deleted this deployment (%s)",
            idle,
            self.ttl,
            ", ".join(deleted) or "already gone",
        )
        return True
