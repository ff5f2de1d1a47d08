"""ktlite: run a Python function or class on N pods with a distributed-training rank env.

Example:
    >>> import ktlite as kt
    >>> remote = kt.fn(train).to(kt.Compute(cpus=2).distribute("pytorch", workers=2, num_proc=2))
    >>> results = remote(epochs=3)   # results[r] came from RANK r
"""

__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING, Any

# Public names load on first use: rank processes import only ktlite.protocol, and must
# not pay for the client (httpx) at every start.
_EXPORTS = {
    "images": "ktlite.images",
    "distributed": "ktlite.distributed",
    "Plan": "ktlite.backends.base",
    "Compute": "ktlite.compute", "Volume": "ktlite.compute",
    "Image": "ktlite.images",
    "App": "ktlite.apps", "app": "ktlite.apps",  # not "ktlite.app": kt.app is the function
    "Future": "ktlite.futures",
    "Host": "ktlite.hosts", "Hosts": "ktlite.hosts",
    "PerRank": "ktlite.rankdata", "per_rank": "ktlite.rankdata",
    "Cls": "ktlite.remote", "Fn": "ktlite.remote", "RemoteClass": "ktlite.remote",
    "RemoteFunction": "ktlite.remote", "cls": "ktlite.remote", "fn": "ktlite.remote",
    **{name: "ktlite.errors" for name in (
        "AuthError", "CallCancelled", "CallTimeout", "ConfigError", "DeployError", "KtliteError",
        "LaunchTimeout", "LocalBackendWarning", "NotDeployedError", "PodUnreachable",
        "ProtocolMismatch", "QuorumTimeout", "RankDied", "RankFailure", "RemoteError",
        "RemoteException", "ReplicaFailed", "SerializationError")},
}

if TYPE_CHECKING:
    from ktlite import distributed, images
    from ktlite.apps import App, app
    from ktlite.backends.base import Plan
    from ktlite.compute import Compute, Volume
    from ktlite.errors import (
        AuthError,
        CallCancelled,
        CallTimeout,
        ConfigError,
        DeployError,
        KtliteError,
        LaunchTimeout,
        LocalBackendWarning,
        NotDeployedError,
        PodUnreachable,
        ProtocolMismatch,
        QuorumTimeout,
        RankDied,
        RankFailure,
        RemoteError,
        RemoteException,
        ReplicaFailed,
        SerializationError,
    )
    from ktlite.futures import Future
    from ktlite.hosts import Host, Hosts
    from ktlite.images import Image
    from ktlite.rankdata import PerRank, per_rank
    from ktlite.remote import Cls, Fn, RemoteClass, RemoteFunction, cls, fn


# The submodule ktlite.compute (kt.Compute) shares its name with the @kt.compute decorator:
# import it first, so that binding the decorator below is what stays.
from ktlite import compute as _compute_module  # noqa: E402, F401
from ktlite.decorators import compute, distribute  # noqa: E402


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ktlite' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name in ("images", "distributed") else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "App",
    "AuthError",
    "CallCancelled",
    "CallTimeout",
    "Cls",
    "Compute",
    "ConfigError",
    "DeployError",
    "Fn",
    "Future",
    "Host",
    "Hosts",
    "Image",
    "KtliteError",
    "LaunchTimeout",
    "LocalBackendWarning",
    "NotDeployedError",
    "PerRank",
    "Plan",
    "PodUnreachable",
    "ProtocolMismatch",
    "QuorumTimeout",
    "RankDied",
    "RankFailure",
    "RemoteClass",
    "RemoteError",
    "RemoteException",
    "RemoteFunction",
    "ReplicaFailed",
    "SerializationError",
    "Volume",
    "__version__",
    "app",
    "cls",
    "compute",
    "distribute",
    "distributed",
    "fn",
    "images",
    "per_rank",
]
