"""``kt.Volume``: a persistent volume mounted into every pod, validated at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ktlite.errors import ConfigError
from ktlite.specs.quantities import memory_quantity

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod")


@dataclass(frozen=True)
class Volume:
    """A persistent volume mounted into every pod: a PVC on Kubernetes; locally the directory
    ``$KTLITE_HOME/volumes/<name>`` (see docs/local_backend.md).

    Args:
        name: the volume (and PVC) name.
        size: capacity such as "10Gi".
        mount_path: where it appears in the pod.
        access_mode: "ReadWriteMany" (shared across pods) or "ReadWriteOnce".
        storage_class: the Kubernetes StorageClass; None uses the cluster default.
    """

    name: str
    size: str = "10Gi"
    mount_path: str = ""
    access_mode: str = "ReadWriteMany"
    storage_class: str | None = None
    namespace: str | None = (
        None  # Kubetorch's: must be the deployment's (pods mount their own namespace's PVCs)
    )
    volume_name: str | None = None  # bind the claim to this PersistentVolume

    @classmethod
    def from_name(cls, name: str, mount_path: str | None = None, **kwargs: Any) -> Volume:
        """An existing PersistentVolumeClaim, mounted at ``mount_path`` (default ``/<name>``);
        the same as naming it in ``Compute(volumes=["name"])``."""
        return cls(name, mount_path=mount_path or "", **kwargs)

    def _refuse(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"Volume.{what}() is not supported: ktlite creates a kt.Volume's claim with the deployment that "
            "mounts it and deletes it with teardown(volumes=True) (`ktlite teardown NAME --volumes`); "
            "look at claims with `kubectl get pvc`"
        )

    def create(self) -> Volume:
        raise self._refuse("create")

    def delete(self) -> None:
        raise self._refuse("delete")

    def exists(self) -> bool:
        raise self._refuse("exists")

    def ssh(self) -> None:
        raise self._refuse("ssh")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not DNS_LABEL.match(self.name):
            raise ConfigError(
                f"Volume(name={self.name!r}) is not a valid PVC name: use lowercase "
                "letters, digits and '-', at most 63 characters, e.g. 'train-data'"
            )
        object.__setattr__(self, "size", memory_quantity(self.size, "Volume.size"))
        if self.access_mode not in ACCESS_MODES:
            raise ConfigError(
                f"Volume.access_mode={self.access_mode!r}; allowed: ReadWriteMany, "
                "ReadWriteOnce, ReadOnlyMany, ReadWriteOncePod"
            )
        if not self.mount_path:
            object.__setattr__(self, "mount_path", f"/{self.name}")
        if not self.mount_path.startswith("/"):
            raise ConfigError(
                f"Volume.mount_path={self.mount_path!r} must be an absolute path like '/data'"
            )
