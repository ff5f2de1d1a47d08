"""The backends by name, imported lazily: ``get_backend("kubernetes")`` loads only that one.

The registry imports no backend module until one is asked for, and no backend imports the
registry, so the backends and their base class form no import circle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ktlite.config import get as setting
from ktlite.errors import ConfigError

if TYPE_CHECKING:  # for annotations only: importing a backend is what get_backend does lazily
    from ktlite.backends.base import Backend

# name -> (module, class); extras name the pip extra a backend's dependencies come with
BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("ktlite.backends.local", "LocalBackend"),
    "kubernetes": ("ktlite.backends.kubernetes", "KubernetesBackend"),
    "ssh": ("ktlite.backends.ssh", "SshBackend"),
}
NAMES = tuple(BACKENDS)
_EXTRAS = {"ssh": "ssh", "kubernetes": "kubernetes"}


def backend_class(name: str) -> type[Backend]:
    """The class of the backend called ``name``; ConfigError for an unknown name or a backend
    whose optional dependencies are missing."""
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r} is not known; allowed: {', '.join(map(repr, NAMES))}")
    module_name, class_name = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] == "ktlite":
            raise
        extra = _EXTRAS.get(name, name)
        raise ConfigError(f"backend={name!r} needs {e.name or 'a missing package'}: pip install "
                          f"'ktlite[{extra}]' ({e})") from None
    cls: type[Backend] = getattr(module, class_name)
    return cls


def get_backend(name: str | None, namespace: str | None = None, kubeconfig: str | None = None) -> Backend:
    """The backend called ``name``; default: KTLITE_BACKEND, then ``ktlite config``'s
    backend, else "local". ``namespace`` picks the Kubernetes namespace, ``kubeconfig``
    the cluster (default: ``ktlite config``'s, else KUBECONFIG / ~/.kube/config)."""
    chosen = name or setting("backend") or "local"
    return backend_class(chosen).shared(namespace=namespace, kubeconfig=kubeconfig)
