"""``DeploymentSpec``: a deployment as a backend and the call path see it, its pods as one
parsed :class:`~ktlite.specs.podspec.PodSpec`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ktlite.errors import ConfigError
from ktlite.specs.autoscaling import AutoscaleConfig
from ktlite.specs.podspec import PodSpec
from ktlite.specs.spec import DistributedConfig

# the layout of a deployment that does not distribute: built once (it is frozen), not per call
_ONE_POD = DistributedConfig()


@dataclass(frozen=True)
class DeploymentSpec:
    """Everything a backend and the call path need to run a deployment: the only object they see.

    Its pods are ``pod``, a parsed :class:`~ktlite.specs.podspec.PodSpec` that also holds the
    call defaults (``pod.calls``), the backend and its options. ``.to()`` builds it from the
    user's Compute (``DeploymentSpec(name, compute.pod_spec())``) and keeps that Compute on
    the handle it returns (``remote.compute``), not here.
    """

    name: str
    pod: PodSpec
    kind: str = "fn"  # "fn" | "cls"
    detached: bool = False
    # an autoscaled deployment's replica count now (the backends that start replicas
    # themselves, local: the autoscaler asks for this many); None: the initial scale
    replicas: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pod, PodSpec):
            raise ConfigError(
                f"DeploymentSpec({self.name!r}).pod is a {type(self.pod).__name__}; it takes a "
                "ktlite.specs.podspec.PodSpec (a kt.Compute gives its own: compute.pod_spec())"
            )

    @property
    def distributed(self) -> DistributedConfig:
        """The rank layout of one pod's world: an autoscaled deployment's replicas are each a
        world of one pod (RANK 0 of WORLD_SIZE 1)."""
        return self.pod.distributed or _ONE_POD

    @property
    def autoscale(self) -> AutoscaleConfig | None:
        """The autoscaler's config of a served deployment, else None."""
        return self.pod.autoscaling

    @property
    def workers(self) -> int:
        """Pods: the distributed layout's, or an autoscaled deployment's replicas now."""
        if self.autoscale is not None:
            return self.autoscale.initial if self.replicas is None else self.replicas
        return self.distributed.workers

    @property
    def concurrency(self) -> int:
        """Calls each rank process runs at once: ``Compute.concurrency``, else 8 for a
        single-rank class (a server), else 1 (a distributed call's collectives need order)."""
        own = self.pod.calls.concurrency
        if (
            self.autoscale is not None
        ):  # Knative's containerConcurrency; unset: a replica takes many
            return int(self.autoscale.concurrency or own or 32)
        if own is not None:
            return int(own)
        return 8 if self.kind == "cls" and self.distributed.world_size == 1 else 1

    def pod_hash(self) -> str:
        """Hash of the fields that shape a pod; code and rank layout are not among them."""
        blob = json.dumps(self.pod.shape(), sort_keys=True, default=repr).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
