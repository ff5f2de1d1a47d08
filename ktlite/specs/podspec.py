"""The pod spec: what a deployment's pods look like, parsed once. A backend reads nothing else.

``kt.Compute(...).pod_spec()`` builds it (``.to()`` does, through
:class:`ktlite.specs.spec.DeploymentSpec`); a backend test may build one directly. Every value is
parsed: CPUs are a number, memory sizes bytes (with the Kubernetes spelling manifests carry),
the image an :class:`~ktlite.specs.images.Image`, volumes :class:`~ktlite.specs.volume.Volume` objects
or claim names, secrets :class:`~ktlite.specs.secrets.Secret` objects.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ktlite.errors import ConfigError
from ktlite.specs.autoscaling import AutoscaleConfig
from ktlite.specs.call_defaults import CallDefaults
from ktlite.specs.hosts import Hosts
from ktlite.specs.images import Image
from ktlite.specs.kube_options import KubernetesOptions
from ktlite.specs.quantities import memory_quantity, parse_cpus, parse_memory
from ktlite.specs.secrets import Secret
from ktlite.specs.spec import DistributedConfig
from ktlite.specs.volume import Volume


@dataclass(frozen=True)
class Memory:
    """A memory size: ``bytes``, and ``quantity``, its Kubernetes spelling ("8GB" -> "8G")."""

    bytes: int
    quantity: str

    @classmethod
    def parse(cls, value: object, field_name: str = "memory") -> Memory:
        return cls(parse_memory(value, field_name), memory_quantity(value, field_name))

    def __str__(self) -> str:
        return self.quantity


def _memory(value: object, field_name: str) -> Memory | None:
    if value is None or isinstance(value, Memory):
        return value
    return Memory.parse(value, field_name)


def _cpus(value: object, field_name: str) -> float | None:
    return None if value is None else parse_cpus(value, field_name)


@dataclass(frozen=True)
class Resources:
    """What one pod asks of its node. Built from user spellings with :meth:`parse`."""

    cpus: float | None = None
    memory: Memory | None = None
    gpus: int = 0
    cpu_limit: float | None = None
    memory_limit: Memory | None = None
    gpu_type: str | None = None
    shared_memory: Memory | None = None  # /dev/shm's size limit
    disk_size: Memory | None = None  # ephemeral-storage request
    gpu_memory: Memory | None = None  # an annotation, as in Kubetorch: a whole GPU is requested

    def __post_init__(self) -> None:
        for name in ("cpus", "cpu_limit"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(
                    f"Resources.{name}={value!r} must be a number of CPUs > 0; use "
                    "Resources.parse() for spellings such as '500m'"
                )
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise ConfigError(f"gpus={self.gpus!r} must be a whole number >= 0")
        if self.cpu_limit is not None and self.cpu_limit < (self.cpus or 0):
            raise ConfigError(
                f"cpu_limit={self.cpu_limit!r} is below cpus={self.cpus!r}; a limit must be "
                "at least the request"
            )
        if self.memory_limit is not None and self.memory_limit.bytes < (
            self.memory.bytes if self.memory else 0
        ):
            raise ConfigError(
                f"memory_limit={self.memory_limit.quantity!r} is below memory="
                f"{self.memory.quantity if self.memory else None!r}; a limit must be at least the request"
            )

    @classmethod
    def parse(
        cls,
        *,
        cpus: object = None,
        memory: object = None,
        gpus: int = 0,
        cpu_limit: object = None,
        memory_limit: object = None,
        gpu_type: str | None = None,
        shared_memory: object = None,
        disk_size: object = None,
        gpu_memory: object = None,
    ) -> Resources:
        """Resources from the spellings users write: cpus 2, 0.5 or "500m"; memory "4Gi",
        "8GB" or a number of bytes."""
        return cls(
            cpus=_cpus(cpus, "cpus"),
            memory=_memory(memory, "memory"),
            gpus=gpus,
            cpu_limit=_cpus(cpu_limit, "cpu_limit"),
            memory_limit=_memory(memory_limit, "memory_limit"),
            gpu_type=gpu_type,
            shared_memory=_memory(shared_memory, "shared_memory"),
            disk_size=_memory(disk_size, "disk_size"),
            gpu_memory=_memory(gpu_memory, "gpu_memory"),
        )


@dataclass(frozen=True)
class PodSpec:
    """A deployment's pods, parsed: the only description of them a backend reads.

    ``worker`` is the pod spec of a Ray cluster's worker-node pods (ordinals 1..N) where
    ``distribute("ray", worker_node_options=...)`` sizes them apart from the head.
    """

    resources: Resources = field(default_factory=Resources)
    image: Image | None = None
    env: dict[str, str] = field(default_factory=dict)
    volumes: tuple[Volume | str, ...] = ()
    secrets: tuple[Secret, ...] = ()
    working_dir: str | None = None  # the rank processes' working directory on a pod
    freeze: bool = False  # the image already holds everything: no install at pod start
    tls: bool | None = None  # Compute(tls=...); None: the backend's default (tls_default)
    backend: str | None = None
    kubernetes: KubernetesOptions = field(default_factory=KubernetesOptions)
    hosts: Hosts | None = None
    calls: CallDefaults = field(default_factory=CallDefaults)
    distributed: DistributedConfig | None = None
    autoscaling: AutoscaleConfig | None = None
    worker: PodSpec | None = None

    @property
    def merged_env(self) -> dict[str, str]:
        """The image's env with ``env`` over it: what every rank starts with."""
        return {**(self.image.env if self.image is not None else {}), **self.env}

    def for_ordinal(self, ordinal: int) -> PodSpec:
        """What pod ``ordinal`` looks like: this, or a Ray worker node's own spec."""
        return self if ordinal == 0 or self.worker is None else self.worker

    def pod_gpus(self, ordinal: int) -> int:
        """GPUs pod ``ordinal`` requests: its ``gpus``, and on a GPU deployment whose pods
        differ in size, at least one per rank of that pod."""
        gpus = self.for_ordinal(ordinal).resources.gpus
        d = self.distributed
        if not gpus or d is None or d.uniform:
            return gpus
        return max(gpus, d.procs(ordinal))

    def shape(self) -> dict[str, Any]:
        """The fields that shape a pod: a change here restarts pods, anything else does not
        (call defaults, the rank layout, serving). Secrets by description, never values."""
        return {
            "resources": asdict(self.resources),
            "image": None if self.image is None else asdict(self.image),
            "env": dict(self.env),
            "volumes": [asdict(v) if isinstance(v, Volume) else v for v in self.volumes],
            "secrets": [s.describe() for s in self.secrets],
            "working_dir": self.working_dir,
            "freeze": self.freeze,
            "tls": self.tls,
            "backend": self.backend,
            "kubernetes": self.kubernetes.shape(),
            "hosts": None if self.hosts is None else asdict(self.hosts),
            "worker": None if self.worker is None else self.worker.shape(),
        }


POD_FIELDS = tuple(f.name for f in fields(PodSpec))
