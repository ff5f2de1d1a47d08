"""The mode of a deployment: a strategy chosen once, at deploy, that decides where a call goes,
how its results come back, and how loading code, readiness, status and scaling behave.

Three strategies (see ``docs/design-modes.md``):

- :class:`ktlite.modes.fanout.Fanout` (SPMD): every call runs on every rank (or the ranks and
  pods chosen), through the coordinator pod; a list by RANK.
- :class:`ktlite.modes.fanout.HeadOnly` (``distribute("ray"/"monarch")``): the call runs once, on
  the head pod; one value.
- :class:`ktlite.modes.routing.Routing` (``Compute.autoscale``): each call on one replica, chosen by
  load; the replicas follow an autoscaler; one value.

A :class:`ktlite.modes.deploy.Deployment` holds one mode and hands it every call; the mode works
on the deployment through :class:`ktlite.modes.callpath.CallPath`.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from ktlite.backends.base import Applied, Backend, PodEndpoint
from ktlite.errors import ConfigError
from ktlite.modes.callpath import CallOptions, CallPath
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire.launch import Launch


class Mode:
    """The strategy interface; the defaults are a fixed set of pods'.

    Subclasses implement :meth:`load`, :meth:`call`, :meth:`status` and :meth:`restart_failed`.
    """

    #: a call's result is one value (not a list by rank)
    single: bool = True

    def __init__(self, dep: CallPath) -> None:
        self.dep = dep

    # ---- before and after the pods are applied (classmethods: no deployment yet) ---------

    @classmethod
    def check(cls, spec: DeploymentSpec) -> None:
        """What this mode needs on this machine, checked before anything is deployed."""

    @classmethod
    def shape(
        cls, spec: DeploymentSpec, backend: Backend, existing: Applied | None
    ) -> DeploymentSpec:
        """The spec to apply, given the deployment that runs now (``existing``, or None)."""
        return spec

    def deployed(self) -> None:
        """Called once the first code is loaded by ``deploy()``."""

    # ---- code --------------------------------------------------------------------------

    def launch_fields(self) -> dict[str, Any]:
        """What this mode puts in the launch beside the code: the pod addresses the ranks
        see, whether a call's result is one value, and whether each pod is a replica of its own."""
        raise NotImplementedError(f"{type(self).__name__}.launch_fields")

    def load(self, launch: Launch, store: concurrent.futures.Future[Any]) -> None:
        """Load the launch (``launch``: what every pod gets, built by the deployment with
        :meth:`launch_fields`) on the pods; ``store``: where the data store is, for
        ``kt.put/get`` in the ranks (None: none)."""
        raise NotImplementedError(f"{type(self).__name__}.load")

    def adopt(self) -> None:
        """Attached to a running deployment without code of our own (by name)."""

    def check_colocation(self, target: str) -> None:
        """Raise if ``target`` may not be colocated into this deployment's rank processes."""

    def launch_relay(self, timeout: float) -> str | None:
        """The ``x-ktlite-tree`` header of a push that pod 0 relays to every pod; None: the
        caller sends it to each pod itself."""
        return None

    def table_relay(self, timeout: float) -> str | None:
        """The ``x-ktlite-tree`` header with which pod 0 gathers every pod's status
        (``modes.podtable``); None: the caller asks each pod itself."""
        return None

    # ---- calls -------------------------------------------------------------------------

    def parallel_calls(self) -> int:
        """How many submitted calls may be in flight at once."""
        return max(1, self.dep.spec.concurrency)

    def call(
        self,
        parts: list[Any],
        options: CallOptions,
        log: Any = None,
        on_send: Any = None,
        per_rank: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run one call; its values in rank order (one value for a single-valued mode).
        ``log(rank, pod, stream, text)`` prints streamed lines; ``on_send(call_id)`` runs just
        before the call leaves; ``per_rank`` says where each rank's items are in ``parts``."""
        raise NotImplementedError(f"{type(self).__name__}.call")

    def start_call(
        self,
        parts: list[Any],
        options: CallOptions,
        on_send: Any,
        per_rank: dict[str, Any] | None,
        done: Any,
    ) -> bool:
        """Start a call without a thread waiting on it; ``done(values, error)`` once it ended.
        False (the default): this mode's calls go through :meth:`call`."""
        return False

    def cancel_targets(self, eps: list[PodEndpoint]) -> list[PodEndpoint]:
        """The pods to send a call's cancel to, of ``eps``, for it to reach all of them."""
        return eps

    # ---- state -------------------------------------------------------------------------

    def status(self, stuck_after: float | None = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.status")

    def restart_failed(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__}.restart_failed")

    def scaling_status(self) -> dict[str, Any]:
        raise ConfigError(
            f"{self.dep.name!r} is not an autoscaled service: scaling_status() reports the "
            "autoscaler of a deployment made with Compute(...).autoscale(...); status() shows "
            "this deployment's pods and ranks"
        )

    def stop(self) -> None:
        """No more calls: stop what the mode runs in the background (and wake waiting calls)."""
