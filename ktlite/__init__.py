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
    "images": "ktlite.specs.images",
    "distributed": "ktlite.distributed",
    "Plan": "ktlite.backends.base",
    "Compute": "ktlite.api.compute",
    "Volume": "ktlite.specs.volume",
    "Image": "ktlite.specs.images",
    "App": "ktlite.api.apps",
    "app": "ktlite.api.apps",  # not "ktlite.app": kt.app is the function
    "Future": "ktlite.api.futures",
    "Host": "ktlite.specs.hosts",
    "Hosts": "ktlite.specs.hosts",
    "PerRank": "ktlite.net.rankdata",
    "per_rank": "ktlite.net.rankdata",
    "Secret": "ktlite.specs.secrets",
    "secret": "ktlite.specs.secrets",
    "get": "ktlite.datastore.store",
    "ls": "ktlite.datastore.store",
    "put": "ktlite.datastore.store",
    "rm": "ktlite.datastore.store",
    "Cls": "ktlite.api.remote",
    "Fn": "ktlite.api.remote",
    "RemoteClass": "ktlite.api.remote",
    "RemoteFunction": "ktlite.api.remote",
    "cls": "ktlite.api.remote",
    "fn": "ktlite.api.remote",
    **{
        name: "ktlite.errors"
        for name in (
            "AuthError",
            "CallCancelled",
            "CallTimeout",
            "ConfigError",
            "DataStoreError",
            "DeployError",
            "KtliteError",
            "LocalBackendWarning",
            "LaunchTimeout",
            "NotDeployedError",
            "PodUnreachable",
            "ProtocolMismatch",
            "QuorumTimeout",
            "RankDied",
            "RankFailure",
            "RemoteError",
            "RemoteException",
            "ReplicaFailed",
            "SerializationError",
            # Kubetorch's names (ktlite.errors says which ktlite error each is)
            "ControllerRequestError",
            "ImagePullError",
            "KnativeServiceConflictError",
            "KubernetesCredentialsError",
            "NotebookError",
            "PodContainerError",
            "PodTerminatedError",
            "ResourceNotAvailableError",
            "RsyncError",
            "SecretNotFound",
            "ServiceHealthError",
            "ServiceTimeoutError",
            "StartupError",
            "VersionMismatchError",
            "WorkerMembershipChanged",
        )
    },
    **{
        name: "ktlite.api.kubetorch"
        for name in (
            "BroadcastWindow",
            "DebugConfig",
            "Endpoint",
            "LoggingConfig",
            "MetricsConfig",
            "deep_breakpoint",
        )
    },
}

if TYPE_CHECKING:
    from ktlite import distributed
    from ktlite.api.apps import App, app
    from ktlite.api.compute import Compute
    from ktlite.api.futures import Future
    from ktlite.api.kubetorch import (
        BroadcastWindow,
        DebugConfig,
        Endpoint,
        LoggingConfig,
        MetricsConfig,
        deep_breakpoint,
    )
    from ktlite.api.remote import Cls, Fn, RemoteClass, RemoteFunction, cls, fn
    from ktlite.backends.base import Plan
    from ktlite.datastore.store import get, ls, put, rm
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
    from ktlite.net.rankdata import PerRank, per_rank
    from ktlite.specs import images
    from ktlite.specs.hosts import Host, Hosts
    from ktlite.specs.images import Image
    from ktlite.specs.secrets import Secret, secret
    from ktlite.specs.volume import Volume


# The settings module ktlite.config shares its name with Kubetorch's kt.config object, which
# passes the module's own functions through; ktlite.compute is a module (Compute, Volume) that
# is also the @kt.compute decorator when called.
from ktlite import compute  # noqa: E402
from ktlite import config as _config_module  # noqa: E402
from ktlite.api.decorators import async_, autoscale, distribute  # noqa: E402
from ktlite.api.kubetorch import Config as _Config  # noqa: E402

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
