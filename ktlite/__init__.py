"""ktlite: run a Python function or class on N pods with a distributed-training rank env.

Example:
    >>> import ktlite as kt
    >>> remote = kt.fn(train).to(kt.Compute(cpus=2).distribute("pytorch", workers=2, num_proc=2))
    >>> results = remote(epochs=3)   # results[r] came from RANK r
"""

import importlib
from typing import TYPE_CHECKING, Any

from ktlite_wire.version import RELEASE as __version__

# Public names load on first use: `import ktlite` in user code (a rank's, say) must not pay
# for the client (httpx) at every start.
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
    "Secret": "ktlite.secrets", "secret": "ktlite.secrets",
    "get": "ktlite.store", "ls": "ktlite.store", "put": "ktlite.store", "rm": "ktlite.store",
    "Cls": "ktlite.remote", "Fn": "ktlite.remote", "RemoteClass": "ktlite.remote",
    "RemoteFunction": "ktlite.remote", "cls": "ktlite.remote", "fn": "ktlite.remote",
    **{name: "ktlite.errors" for name in (
        "AuthError", "CallCancelled", "CallTimeout", "ConfigError", "DataStoreError", "DeployError",
        "KtliteError", "LocalBackendWarning",
        "LaunchTimeout", "NotDeployedError", "PodUnreachable", "ProtocolMismatch", "QuorumTimeout",
        "RankDied", "RankFailure", "RemoteError", "RemoteException", "ReplicaFailed",
        "SerializationError",
        # Kubetorch's names (ktlite.errors says which ktlite error each is)
        "ControllerRequestError", "ImagePullError", "KnativeServiceConflictError", "KubernetesCredentialsError", "NotebookError",
        "PodContainerError", "PodTerminatedError", "ResourceNotAvailableError", "RsyncError", "SecretNotFound",
        "ServiceHealthError", "ServiceTimeoutError", "StartupError", "VersionMismatchError", "WorkerMembershipChanged")},
    **{name: "ktlite.kubetorch" for name in (
        "BroadcastWindow", "DebugConfig", "Endpoint", "LoggingConfig", "MetricsConfig", "deep_breakpoint")},
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
        ControllerRequestError,
        DataStoreError,
        DeployError,
        ImagePullError,
        KnativeServiceConflictError,
        KtliteError,
        KubernetesCredentialsError,
        LaunchTimeout,
        LocalBackendWarning,
        NotDeployedError,
        NotebookError,
        PodContainerError,
        PodTerminatedError,
        PodUnreachable,
        ProtocolMismatch,
        QuorumTimeout,
        RankDied,
        RankFailure,
        RemoteError,
        RemoteException,
        ReplicaFailed,
        ResourceNotAvailableError,
        RsyncError,
        SecretNotFound,
        SerializationError,
        ServiceHealthError,
        ServiceTimeoutError,
        StartupError,
        VersionMismatchError,
        WorkerMembershipChanged,
    )
    from ktlite.futures import Future
    from ktlite.hosts import Host, Hosts
    from ktlite.images import Image
    from ktlite.kubetorch import (
        BroadcastWindow,
        DebugConfig,
        Endpoint,
        LoggingConfig,
        MetricsConfig,
        deep_breakpoint,
    )
    from ktlite.rankdata import PerRank, per_rank
    from ktlite.remote import Cls, Fn, RemoteClass, RemoteFunction, cls, fn
    from ktlite.secrets import Secret, secret
    from ktlite.store import get, ls, put, rm


# The submodule ktlite.compute (kt.Compute) shares its name with the @kt.compute decorator:
# import it first, so that binding the decorator below is what stays.
# Likewise the settings module ktlite.config and Kubetorch's kt.config object, which passes
# the module's own functions through.
from ktlite import compute as _compute_module  # noqa: E402, F401
from ktlite import config as _config_module  # noqa: E402
from ktlite.decorators import async_, autoscale, compute, distribute  # noqa: E402
from ktlite.kubetorch import Config as _Config  # noqa: E402

config = _Config(_config_module)

from ktlite.logconfig import configure as _configure_logging  # noqa: E402

_configure_logging()  # KTLITE_LOG_LEVEL, and ktlite's warnings on stderr unless the app logs


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
    "BroadcastWindow",
    "CallCancelled",
    "CallTimeout",
    "Cls",
    "Compute",
    "ConfigError",
    "ControllerRequestError",
    "DataStoreError",
    "DebugConfig",
    "DeployError",
    "Endpoint",
    "Fn",
    "Future",
    "Host",
    "Hosts",
    "Image",
    "ImagePullError",
    "KnativeServiceConflictError",
    "KtliteError",
    "KubernetesCredentialsError",
    "LaunchTimeout",
    "LocalBackendWarning",
    "LoggingConfig",
    "MetricsConfig",
    "NotDeployedError",
    "NotebookError",
    "PerRank",
    "Plan",
    "PodContainerError",
    "PodTerminatedError",
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
    "ResourceNotAvailableError",
    "RsyncError",
    "Secret",
    "SecretNotFound",
    "SerializationError",
    "ServiceHealthError",
    "ServiceTimeoutError",
    "StartupError",
    "VersionMismatchError",
    "Volume",
    "WorkerMembershipChanged",
    "__version__",
    "app",
    "async_",
    "autoscale",
    "cls",
    "compute",
    "config",
    "deep_breakpoint",
    "distribute",
    "distributed",
    "fn",
    "get",
    "images",
    "ls",
    "per_rank",
    "put",
    "rm",
    "secret",
]
