"""Serving options of a deployment: Kubetorch's fixed ``replicas`` or an autoscaler's config.

``kt.Compute(replicas=N)`` and ``compute.autoscale(...)`` fill them, ``compute.serving``
holds them. A deployment with them sends each call to one replica (see ``ktlite.modes.serving``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ktlite.errors import ConfigError
from ktlite.specs.autoscaling import AutoscaleConfig


@dataclass(frozen=True)
class ServingOptions:
    """Args:
    replicas: Kubetorch's N load-balanced replicas (``autoscale(min_scale=N, max_scale=N)``),
        or with ``distribute()`` its worker count.
    autoscaling: set by ``compute.autoscale(...)``.
    """

    replicas: int | None = None
    autoscaling: AutoscaleConfig | None = None

    def __post_init__(self) -> None:
        if self.replicas is not None and (
            isinstance(self.replicas, bool)
            or not isinstance(self.replicas, int)
            or self.replicas < 1
        ):
            raise ConfigError(f"replicas={self.replicas!r} must be a whole number >= 1")
        if self.autoscaling is not None and not isinstance(self.autoscaling, AutoscaleConfig):
            raise ConfigError(
                f"autoscaling={self.autoscaling!r}: use compute.autoscale(min_scale=..., ...)"
            )


SERVING_FIELDS = tuple(f.name for f in fields(ServingOptions))
