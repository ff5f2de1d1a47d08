"""Kubernetes options of a deployment: where its pods go and what their API objects carry.

They shape the pods on a Kubernetes cluster only (the local backend warns that it ignores
them, see ``ktlite.backends.kube_only``); ``kt.Compute(namespace=..., node_selector=...)``
fills them, ``compute.kubernetes`` holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ktlite.errors import ConfigError
from ktlite.specs.volume import DNS_LABEL
from ktlite_wire.storedir import KeyRefused, check_key

PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# the pods' user and group by default: the first user id of most Linux images, the id that
# Python and ML images which ship a non-root user give it (Jupyter's, Hugging Face's), so
# such an image runs as its own user; ktlite's images (images/) make user 1000 too
DEFAULT_UID = 1000
MAX_UID = 2**31 - 1  # Kubernetes' runAsUser is an int64 the kernel takes as a 31-bit id


@dataclass(frozen=True)
class KubernetesOptions:
    """Placement and metadata of a deployment's pods on Kubernetes.

    Args:
        namespace: the namespace of every object (default: the kubeconfig context's).
        service_account: the pods' ServiceAccount.
        image_pull_policy: "Always", "IfNotPresent" or "Never".
        priority_class: the pods' PriorityClass.
        node_selector: node labels a pod's node must carry.
        tolerations: taints the pods tolerate (Kubernetes' toleration objects).
        labels, annotations: extra metadata on every pod.
        queue_name: a Kueue LocalQueue admitting the pods.
        service_template: merged deeply into each StatefulSet.
        gpu_anti_affinity: a CPU-only pod stays off nodes with GPUs.
        kubeconfig_path: the cluster's kubeconfig (does not shape the pods).
        run_as_user: the user (and group) id the pods run as, 1000 by default: non-root,
            no privilege escalation, every capability dropped. ``0`` runs them as root with
            the container runtime's default capabilities, for images that need it (a
            ``run_bash`` step that calls ``apt-get``, a volume that ignores ``fsGroup``).
        store_access: data store prefixes the pods may reach besides their own (the deployment's
            name): ``{"datasets": "read", "shared/out": "write"}``, or a list of prefixes to
            read (does not shape the pods: it travels with each push of the code).
    """

    namespace: str | None = None
    service_account: str | None = None
    image_pull_policy: str | None = None
    priority_class: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    queue_name: str | None = None
    service_template: dict[str, Any] | None = None
    gpu_anti_affinity: bool = False
    kubeconfig_path: str | None = None
    run_as_user: int = DEFAULT_UID
    store_access: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tolerations", tuple(self.tolerations))
        object.__setattr__(self, "store_access", store_access(self.store_access))
        if self.image_pull_policy not in (None, *PULL_POLICIES):
            raise ConfigError(
                f"image_pull_policy={self.image_pull_policy!r}; allowed: {', '.join(PULL_POLICIES)}"
            )
        if not isinstance(self.gpu_anti_affinity, bool):
            raise ConfigError(f"gpu_anti_affinity={self.gpu_anti_affinity!r} must be True or False")
        if self.queue_name is not None and (
            not isinstance(self.queue_name, str) or not DNS_LABEL.match(self.queue_name)
        ):
            raise ConfigError(
                f"queue_name={self.queue_name!r} must name a Kueue LocalQueue (a DNS label)"
            )
        if self.service_template is not None and not isinstance(self.service_template, dict):
            raise ConfigError(
                f"service_template={self.service_template!r} must be a dict merged into the "
                "generated StatefulSet, e.g. {'spec': {'template': {'spec': {...}}}}"
            )
        if (
            isinstance(self.run_as_user, bool)
            or not isinstance(self.run_as_user, int)
            or not 0 <= self.run_as_user <= MAX_UID
        ):
            raise ConfigError(
                f"run_as_user={self.run_as_user!r} must be a user id from 0 to {MAX_UID}: "
                f"{DEFAULT_UID} (the default) runs the pods as a non-root user, 0 as root for an "
                "image that needs it"
            )
        if self.kubeconfig_path is not None and not isinstance(self.kubeconfig_path, str):
            raise ConfigError(f"kubeconfig_path={self.kubeconfig_path!r} must be a path string")

    def shape(self) -> dict[str, Any]:
        """The options that shape a pod (all but the kubeconfig, which picks the cluster)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SHAPING}


_NOT_SHAPING = ("kubeconfig_path", "store_access")
ACCESS_MODES = ("read", "write")


def store_access(value: Any) -> tuple[tuple[str, str], ...]:
    """``Compute(store_access=...)`` as sorted ``(prefix, "read" | "write")`` pairs, or a
    ConfigError naming the bad entry."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, tuple, list)) for v in value):
        pairs = [(v, "read") if isinstance(v, str) else tuple(v) for v in value]
    else:
        raise ConfigError(
            f"store_access={value!r} must map data store prefixes to 'read' or 'write', e.g. "
            "{'datasets': 'read', 'shared/out': 'write'}, or list prefixes to read"
        )
    out: dict[str, str] = {}
    for pair in pairs:
        prefix, mode = pair if len(pair) == 2 else (pair, None)
        if mode not in ACCESS_MODES:
            raise ConfigError(f"store_access[{prefix!r}]={mode!r}; allowed: 'read', 'write'")
        if prefix in ("", "/"):
            raise ConfigError(
                "store_access cannot grant the data store's root: a deployment's pods reach "
                "named prefixes only, e.g. {'datasets': 'read'}"
            )
        try:
            prefix = check_key(prefix, what="store_access prefix")
        except KeyRefused as e:
            raise ConfigError(str(e)) from None
        out[prefix] = "write" if "write" in (mode, out.get(prefix)) else "read"
    return tuple(sorted(out.items()))


KUBERNETES_FIELDS = tuple(f.name for f in fields(KubernetesOptions))
