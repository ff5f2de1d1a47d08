"""The replicas of an autoscaled deployment as its caller routes to them: each one's calls in
flight, whether it runs the current launch, and the calls waiting here for room, in order.

Shared by the router (:class:`ktlite.modes.routing.Routing`) and the scaling thread
(:class:`ktlite.modes.serving.ReplicaScaler`); every field is read and written under ``lock``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ktlite.backends.base import PodEndpoint
from ktlite_wire.launch import Launch


@dataclass
class Replica:
    """One replica as the router sees it."""

    ep: PodEndpoint
    inflight: int = 0  # this caller's calls running on it
    reported: int = 0  # the calls its server says it runs (every caller's)
    others: int = 0  # of those, the calls of other callers (the server's count less ours then)
    served: int = 0  # calls it finished for this caller
    draining: bool = False  # takes no new calls: it stops once idle
    launch_id: str = ""  # the launch it reported loaded

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.ep.name,
            "ip": self.ep.ip,
            "inflight": self.inflight + self.others,
            "served": self.served,
            "draining": self.draining,
            "launch_id": self.launch_id,
        }


@dataclass
class Load:
    """What the scaling thread measures between two ticks."""

    finished: list[float] = field(default_factory=list)  # when calls ended (for rps)
    last_call: float | None = None


class ReplicaSet:
    """The replicas by pod name, the calls waiting for one, and what the scaler measures."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.replicas: dict[str, Replica] = {}
        self.waiting = 0
        self.line: deque[threading.Condition] = (
            deque()
        )  # calls waiting for a replica, in arrival order
        self.load = Load()
        self.launch: Launch | None = None  # the current launch, for replicas that lack it
        self.stale: str | None = (
            None  # set when the deployment was torn down or redeployed elsewhere
        )

    def admit(self, ep: PodEndpoint, launch_id: str) -> None:
        """Route calls to ``ep`` from now on (it runs ``launch_id``). Holds ``cond``."""
        replica = self.replicas.get(ep.name)
        if replica is None or replica.ep.incarnation != ep.incarnation:
            replica = self.replicas[ep.name] = Replica(ep)
        replica.launch_id = launch_id
        replica.draining = False

    def live(self) -> list[Replica]:
        """The replicas not draining. Holds ``cond``."""
        return [r for r in self.replicas.values() if not r.draining]

    def next_in_line(self) -> None:
        """Wake the first waiting call (only it may take a free slot). Holds ``cond``."""
        if self.line:
            self.line[0].notify()

    def everyone(self) -> None:
        """Wake every waiting call: replicas, code or the deployment changed. Holds ``cond``."""
        for waiter in self.line:
            waiter.notify()
        self.cond.notify_all()

    def forget(self, why: str) -> None:
        """No replica takes calls any more (``why`` is what waiting and later calls raise)."""
        with self.cond:
            self.replicas.clear()
            self.stale = why
            self.everyone()
