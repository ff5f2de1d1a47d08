"""``DeploymentSpec``: a deployment as a backend sees it, its pods as one parsed
:class:`~ktlite.specs.podspec.PodSpec`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ktlite.errors import ConfigError
from ktlite.specs.autoscaling import AutoscaleConfig
from ktlite.specs.podspec import PodSpec
from ktlite.specs.spec import DistributedConfig

if TYPE_CHECKING:  # the API layer above: a backend never loads it
    from ktlite.api.compute import Compute


@dataclass(frozen=True)
class DeploymentSpec:
    """Everything a backend needs to run a deployment: the only object it sees.

    Built from the user's ``compute`` (``DeploymentSpec(name, compute)``), whose
    :meth:`~ktlite.api.compute.Compute.pod_spec` gives ``pod`` once; or from a ``pod`` alone.
    Backends read ``pod``; ``compute`` is kept for the caller (``remote.compute``).
    """

    name: str
    # the user's Compute; None only in a spec built from a pod spec alone (backend tests),
    # which no caller reads
    compute: Compute = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    kind: str = "fn"  # "fn" | "cls"
    detached: bool = False
    # an autoscaled deployment's replica count now (the backends that start replicas
    # themselves, local: the autoscaler asks for this many); None: the initial scale
    replicas: int | None = None
    pod: PodSpec = field(default=None)  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.pod is None:
            if self.compute is None:
                raise ConfigError(
                    f"DeploymentSpec({self.name!r}) needs compute= (a kt.Compute) or pod= "
                    "(a ktlite.specs.podspec.PodSpec)"
                )
            object.__setattr__(self, "pod", self.compute.pod_spec())
        elif not isinstance(self.pod, PodSpec):
            raise ConfigError(
                f"DeploymentSpec.pod={self.pod!r} must be a ktlite.specs.podspec.PodSpec"
            )

    @property
    def distributed(self) -> DistributedConfig:
        """The rank layout of one pod's world: an autoscaled deployment's replicas are each a
        world of one pod (RANK 0 of WORLD_SIZE 1)."""
        return self.pod.distributed or DistributedConfig()

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
