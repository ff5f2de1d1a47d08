"""Compute fields that only a Kubernetes cluster acts on, and the warning that names them.

A local pod is a process of this machine: no scheduler places it (``node_selector``,
``tolerations``, ``priority_class``, ``gpu_type``), no API object carries its metadata
(``labels``, ``annotations``, ``service_account``, ``queue_name``, ``gpu_memory``,
``service_template``), no container runtime runs an image (``image``'s base image and its
``pip_install`` / ``run_bash`` steps, ``image_pull_policy``, ``freeze``, ``working_dir``), and it
shares this machine's ``/dev/shm``, disk and CPUs (``shared_memory``, ``cpu_limit``,
``disk_size``, ``gpu_anti_affinity``), and it reads the data store's directory as the caller
does (``store_access``: nothing to scope); it runs as the caller's user (``run_as_user``).
``namespace`` and ``secrets`` do act locally (the data
store's namespace; secrets reach the ranks). docs/local_backend.md says what each field does
locally.
"""

from __future__ import annotations

import warnings

from ktlite.errors import LocalBackendWarning
from ktlite.specs.images import DEFAULT_IMAGE
from ktlite.specs.kube_options import DEFAULT_UID
from ktlite.specs.podspec import PodSpec

KUBE_ONLY = (
    "gpu_type",
    "cpu_limit",
    "shared_memory",
    "node_selector",
    "tolerations",
    "priority_class",
    "labels",
    "annotations",
    "service_account",
    "image_pull_policy",
    # Kubetorch's fields that shape a Kubernetes pod
    "disk_size",
    "gpu_memory",
    "gpu_anti_affinity",
    "working_dir",
    "queue_name",
    "service_template",
    "freeze",
    "run_as_user",
    # local pods are processes of the caller's user, reading the store's directory directly
    "store_access",
)


def _setting(pod: PodSpec, name: str) -> object:
    """The Compute field ``name`` as the pod spec holds it."""
    for part in (pod.resources, pod.kubernetes):
        if hasattr(part, name):
            return getattr(part, name)
    return getattr(pod, name)


def _is_set(name: str, value: object) -> bool:
    """Whether the Compute sets field ``name`` to other than its default."""
    if name == "run_as_user":  # a number whose default is not 0
        return value != DEFAULT_UID
    return value not in (None, "", {}, (), False)


def unused_fields(pod: PodSpec, workers: int) -> list[str]:
    """The fields of ``pod`` (or of its Ray worker pods') that a local pod ignores."""
    found: list[str] = []
    for one in [pod.for_ordinal(i) for i in range(min(workers, 2))]:  # the head, a worker
        image = one.image
        if image is not None and (
            image.image_id != DEFAULT_IMAGE or any(kind != "env" for kind, _ in image.steps)
        ):
            found.append("image")
        found += [name for name in KUBE_ONLY if _is_set(name, _setting(one, name))]
    return sorted(set(found), key=found.index)


def warn_unused(name: str, fields: list[str], notes: list[str]) -> None:
    """One warning for deployment ``name``: the ``fields`` that do nothing locally, and
    ``notes`` on what happens instead (where a volume's data is)."""
    parts = []
    if fields:
        parts.append(
            f"on the local backend these Compute fields do nothing (Kubernetes acts on them): "
            f"{', '.join(fields)}"
        )
    parts += notes
    warnings.warn(
        f"deployment {name!r}: {'; '.join(parts)}; see docs/local_backend.md",
        LocalBackendWarning,
        stacklevel=3,
    )
