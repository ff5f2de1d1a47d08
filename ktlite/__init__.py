"""ktlite: run a Python function or class on N pods with a distributed-training rank env.

Example:
    >>> import ktlite as kt
    >>> remote = kt.fn(train).to(kt.Compute(cpus=2).distribute("pytorch", workers=2, num_proc=2))
    >>> results = remote(epochs=3)   # results[r] came from RANK r
"""

__version__ = "0.1.0"

from ktlite import images
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
    NotDeployedError,
    PodUnreachable,
    ProtocolMismatch,
    RankDied,
    RankFailure,
    RemoteError,
    RemoteException,
    SerializationError,
)
from ktlite.images import Image
from ktlite.remote import Cls, Fn, RemoteClass, RemoteFunction, cls, fn

__all__ = [
    "AuthError",
    "CallCancelled",
    "CallTimeout",
    "Cls",
    "Compute",
    "ConfigError",
    "DeployError",
    "Fn",
    "Image",
    "KtliteError",
    "LaunchTimeout",
    "NotDeployedError",
    "Plan",
    "PodUnreachable",
    "ProtocolMismatch",
    "RankDied",
    "RankFailure",
    "RemoteClass",
    "RemoteError",
    "RemoteException",
    "RemoteFunction",
    "SerializationError",
    "Volume",
    "__version__",
    "cls",
    "fn",
    "images",
]
