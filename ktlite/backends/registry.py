"""The backends by name, imported lazily: ``get_backend("kubernetes")`` loads only that one.

The registry imports no backend module until one is asked for, and no backend imports the
registry, so the backends and their base class form no import circle.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ktlite.config import get as setting
from ktlite.errors import ConfigError

if TYPE_CHECKING:  # for annotations only: importing a backend is what get_backend does lazily
    from ktlite.backends.base import Backend


@dataclass(frozen=True)
class Traits:
    """What a backend is, declared here so that callers decide without importing it (its
    optional methods are protocols in :mod:`ktlite.backends.capabilities`)."""

    hosts: bool = False  # its pods are the machines the user names: Compute(hosts=[...])
    serves: bool = True  # runs load-balanced replicas (.autoscale(), Compute(replicas=N))
    existing_secrets: bool = False  # reuses Secrets that already exist where its pods run
    local_files: bool = False  # its pods run on this machine and see the caller's folders
    pods_outlive_caller: bool = True  # pods not detached keep running after the caller exits
    store: str | None = (
        None  # kt.put/get's store: "directory" (the caller's), "pod" (one of its own), none
    )


# name -> (module, class, traits); extras name the pip extra a backend's dependencies come with
BACKENDS: dict[str, tuple[str, str, Traits]] = {
    "local": (
        "ktlite.backends.local",
        "LocalBackend",
        Traits(local_files=True, pods_outlive_caller=False, store="directory"),
    ),
    "kubernetes": (
        "ktlite.backends.kubernetes",
        "KubernetesBackend",
        Traits(existing_secrets=True, store="pod"),
    ),
    "ssh": ("ktlite.backends.ssh", "SshBackend", Traits(hosts=True, serves=False)),
}
NAMES = tuple(BACKENDS)
HOSTS_BACKEND = next(name for name, (_, _, t) in BACKENDS.items() if t.hosts)
_EXTRAS = {"ssh": "ssh", "kubernetes": "kubernetes"}


def backend_class(name: str) -> type[Backend]:
    """The class of the backend called ``name``; ConfigError for an unknown name or a backend
    whose optional dependencies are missing."""
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r} is not known; allowed: {', '.join(map(repr, NAMES))}")
    module_name, class_name, _ = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] == "ktlite":
            raise
        extra = _EXTRAS.get(name, name)
        raise ConfigError(
            f"backend={name!r} needs {e.name or 'a missing package'}: pip install "
            f"'ktlite[{extra}]' ({e})"
        ) from None
    cls: type[Backend] = getattr(module, class_name)
    return cls


def traits(name: str | None) -> Traits:
    """The traits of the backend called ``name`` (None, or a name not registered here such as
    a test's own backend: the defaults)."""
    entry = BACKENDS.get(name or "")
    return entry[2] if entry is not None else Traits()


def get_backend(
    name: str | None, namespace: str | None = None, kubeconfig: str | None = None
) -> Backend:
    """The backend called ``name``; default: KTLITE_BACKEND, then ``ktlite config``'s
    backend, else "local". ``namespace`` picks the Kubernetes namespace, ``kubeconfig``
    the cluster (default: ``ktlite config``'s, else KUBECONFIG / ~/.kube/config)."""
    chosen = name or setting("backend") or "local"
    return backend_class(chosen).shared(namespace=namespace, kubeconfig=kubeconfig)
