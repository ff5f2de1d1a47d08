"""Every error ktlite raises, in one place.

Hierarchy::

    KtliteError
    ├── ConfigError (ValueError)          bad user input, raised before anything starts
    │   └── SerializationError (TypeError)  a function or argument that cannot be pickled
    ├── DeployError                        pods could not be started or loaded
    │   ├── LaunchTimeout (TimeoutError)   pods did not become ready within launch_timeout
    │   ├── ImagePullError                 a pod's image cannot be pulled
    │   ├── ResourceNotAvailableError      no node can hold a pod (unschedulable)
    │   ├── SecretNotFound                 a Secret the pods name does not exist
    │   ├── StartupError                   a pod's container or setup failed while starting
    │   └── PodTerminatedError             a pod was evicted, OOM-killed or failed
    ├── NotDeployedError                   calling a deployment that does not exist (anymore)
    │   └── StaleLaunch                    a newer .to() of the same service replaced this launch
    ├── PodUnreachable (ConnectionError)   a pod's server cannot be reached or died mid-call
    ├── AuthError                          the server refused the deployment token
    ├── ProtocolMismatch                   client and server speak different protocol versions
    ├── DataStoreError                     kt.put/get/ls/rm failed: a missing key, an unreachable store
    └── RemoteError                        one or more ranks failed a call
        ├── RemoteException                a rank raised an exception that cannot be rebuilt here
        ├── RankDied                       a rank process exited during the call
        │   └── WorkerMembershipChanged    (also PodUnreachable) a pod was lost or replaced
        │                                  during the call
        ├── CallTimeout (TimeoutError)     the call ran past its timeout
        ├── QuorumTimeout (TimeoutError)   a pod was unreachable before the call: nothing ran
        └── CallCancelled                  the call was cancelled (Ctrl-C, sibling failure)
    ReplicaFailed                          (raised on a pod) a kt.app replica's command failed
    LocalBackendWarning (UserWarning)      Compute fields that do nothing on the local backend

Kubetorch's exception names are these classes (``ServiceTimeoutError`` is ``LaunchTimeout``,
``VersionMismatchError`` is ``ProtocolMismatch``), so ``except kt.PodTerminatedError`` written for
Kubetorch works unchanged.

A user exception raised on a rank is re-raised in the caller *with its own type*: ktlite
builds a subclass of both the original type and :class:`RemoteError`, so
``except ValueError`` and ``except kt.RemoteError`` both catch it, and the per-rank
outcomes travel on it (``err.results``, ``err.outcomes``, ``err.failures``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ktlite_wire.status import Status


class KtliteError(Exception):
    """Base of every ktlite error."""


class ConfigError(KtliteError, ValueError):
    """Bad user input: names the field, the value, what is allowed and the fix."""


class SerializationError(ConfigError, TypeError):
    """A function, class or argument that cannot be pickled; names the offending object."""


class DeployError(KtliteError):
    """Pods could not be started, or the code could not be loaded on them."""


class LaunchTimeout(DeployError, TimeoutError):
    """Pods were not ready before ``launch_timeout``."""


class ImagePullError(DeployError):
    """A pod's image cannot be pulled (wrong name or tag, a private registry, no network)."""


class ResourceNotAvailableError(DeployError):
    """No node can hold a pod: not enough CPU, memory or GPUs, or no node matches its
    selectors and tolerations."""


class SecretNotFound(DeployError):
    """A Kubernetes Secret the pods name (``Compute(secrets=[...])``) does not exist."""


class StartupError(DeployError):
    """A pod's container or its setup steps failed while starting; the message holds its log."""


class PodTerminatedError(DeployError):
    """A pod was evicted, OOM-killed or failed.

    Attributes:
        pod_name: the pod.
        reason: Kubernetes' reason ("OOMKilled", "Evicted", "Error", ...).
        events: what Kubernetes said about the pod, newest last.
    """

    def __init__(
        self, message: str, pod_name: str = "", reason: str = "", events: list[str] | None = None
    ) -> None:
        super().__init__(message)
        self.pod_name, self.reason, self.events = pod_name, reason, list(events or [])

    @property
    def is_oom(self) -> bool:
        return self.reason == "OOMKilled"

    def __reduce__(self) -> Any:
        return (type(self), (self.args[0], self.pod_name, self.reason, self.events))


class ControllerRequestError(DeployError):
    """A request to the cluster failed: ktlite has no controller, so this is the API server
    refusing or not answering (Kubetorch's name; ``KubeApiError`` is one)."""


class KubernetesCredentialsError(ConfigError):
    """The kubeconfig (or in-cluster credentials) could not be loaded."""


class NotebookError(KtliteError):
    """Kubetorch's notebook launcher failed. ktlite has no notebook launcher: never raised."""


class KnativeServiceConflictError(DeployError):
    """Kubetorch's Knative service clash. ktlite creates no Knative services: never raised."""


class RsyncError(DeployError):
    """Kubetorch's file sync failed. ktlite ships code by value (no rsync): never raised."""


# Kubetorch's names for the same errors
ServiceTimeoutError = LaunchTimeout
PodContainerError = StartupError


class NotDeployedError(KtliteError):
    """The deployment does not exist: it was never deployed or has been torn down."""


class StaleLaunch(NotDeployedError):
    """A served deployment's launch older than the one a replica holds: a newer ``.to()`` of
    the same service deployed its code since (the replica refused it: ``stale_launch``)."""


class PodUnreachable(KtliteError, ConnectionError):
    """A pod's server could not be reached, or went away during a call. ``delivered`` is
    False when the request certainly never reached a pod server (nothing ran)."""

    def __init__(self, *args: object, delivered: bool = True) -> None:
        super().__init__(*args)
        self.delivered = delivered


class AuthError(KtliteError):
    """The pod refused the request's token (HTTP 401)."""


class ProtocolMismatch(KtliteError):
    """The client and the pod's server speak different protocol versions."""


VersionMismatchError = ProtocolMismatch  # Kubetorch's name
ServiceHealthError = PodUnreachable  # Kubetorch's name: a pod that does not answer


class DataStoreError(KtliteError):
    """The data store (``kt.put/get/ls/rm``) failed: a missing key, a key of another type, a
    store that cannot be created or reached. ``key`` names the key concerned, if any."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass
class RankFailure:
    """What went wrong on one rank: its exception (or None), its pod and the remote traceback."""

    rank: int
    pod: str
    kind: Status  # a str enum: "error" | "died" | "unreachable" | "stale" | "cancelled" | "timeout"
    message: str
    traceback: str = ""
    exception: BaseException | None = field(default=None, repr=False)
    at: float = 0.0  # wall-clock time the pod knew of it: the earliest failure is the cause

    def describe(self) -> str:
        head = f"rank {self.rank} on pod {self.pod}: {self.message}"
        if self.traceback:
            return head + "\n" + _indent(self.traceback.rstrip())
        return head


class RemoteError(KtliteError):
    """A call failed on one or more ranks.

    Attributes:
        failures: one :class:`RankFailure` per rank that did not return a value.
        outcomes: rank -> value, or the exception that rank raised / the failure.
        results: rank -> value, for the ranks that finished.
    """

    failures: list[RankFailure]
    outcomes: dict[int, Any]

    def __init__(
        self,
        message: str = "",
        failures: list[RankFailure] | None = None,
        outcomes: dict[int, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.failures = failures or []
        self.outcomes = outcomes or {}

    @property
    def results(self) -> dict[int, Any]:
        failed = {f.rank for f in self.failures}
        return {r: v for r, v in self.outcomes.items() if r not in failed}

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(f.rank for f in self.failures)


class RemoteException(RemoteError):
    """A rank raised an exception whose type cannot be rebuilt in the caller.

    Attributes:
        type_name: the qualified name of the remote exception type.
        remote_traceback: the traceback text from the rank.
    """

    def __init__(self, message: str, type_name: str, remote_traceback: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.type_name = type_name
        self.remote_traceback = remote_traceback


class RankDied(RemoteError):
    """A rank process exited (crash, signal, OOM kill) while running a call."""


class WorkerMembershipChanged(RankDied, PodUnreachable):
    """A pod of the deployment was lost or replaced while a call ran on it (Kubetorch's name).

    It is a :class:`RankDied` (the lost pod's ranks died) and a :class:`PodUnreachable`, so
    ktlite's ``except`` forms catch it too; the next call finds the replacement pods and
    pushes the code to them.

    Attributes:
        previous_ips: the pods' IPs when the call started, by ordinal.
        current_ips: the pods' IPs now (a pod still being replaced is missing).
        removed_ips, added_ips: the difference.
    """

    def __init__(
        self,
        message: str = "",
        failures: list[RankFailure] | None = None,
        outcomes: dict[int, Any] | None = None,
        *,
        previous_ips: list[str] | None = None,
        current_ips: list[str] | None = None,
    ) -> None:
        super().__init__(message, failures, outcomes)
        self.previous_ips = list(previous_ips or [])
        self.current_ips = list(current_ips or [])

    @property
    def removed_ips(self) -> list[str]:
        return [ip for ip in self.previous_ips if ip not in self.current_ips]

    @property
    def added_ips(self) -> list[str]:
        return [ip for ip in self.current_ips if ip not in self.previous_ips]


class CallTimeout(RemoteError, TimeoutError):
    """The call did not finish within its timeout; the ranks were stopped."""


class QuorumTimeout(RemoteError, TimeoutError):
    """Not every pod was reachable within ``quorum_timeout``; no rank started the call."""


class ReplicaFailed(KtliteError):
    """A ``kt.app`` replica's command exited non-zero; the caller gets it as a RemoteError too."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> Any:  # travels back from the pod by pickle
        return (type(self), (self.args[0], self.exit_code))


class LocalBackendWarning(UserWarning):
    """A local deployment sets Compute fields that only Kubernetes acts on (named in the
    message); see docs/local_backend.md. Silence it with ``warnings.filterwarnings``."""


class CallCancelled(RemoteError):
    """The call was cancelled; its ranks were stopped."""


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def with_remote_context(
    exc: BaseException, failures: list[RankFailure], outcomes: dict[int, Any], summary: str
) -> BaseException:
    """Return an exception of ``exc``'s own type that is also a :class:`RemoteError`.

    The original type is kept so ``except ValueError`` still works; the rank context goes
    into ``__notes__`` (shown under the traceback) and onto the object. Falls back to the
    original instance with the same attributes when the type cannot be subclassed.
    """
    cls = type(exc)
    combined: BaseException = exc
    if not isinstance(exc, RemoteError):
        try:
            sub = type(
                cls.__name__,
                (cls, RemoteError),
                {
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "__init__": cls.__init__,
                    "__str__": cls.__str__,
                    "__reduce__": cls.__reduce__,
                },
            )
            made: BaseException = cls.__new__(sub, *exc.args)
            made.args = exc.args
            made.__dict__.update(getattr(exc, "__dict__", {}))
            combined = made
        except Exception:
            combined = exc
    try:
        combined.failures = failures  # type: ignore[attr-defined]
        combined.outcomes = outcomes  # type: ignore[attr-defined]
        if not isinstance(combined, RemoteError):
            done = {r: v for r, v in outcomes.items() if r not in {f.rank for f in failures}}
            combined.results = done  # type: ignore[attr-defined]
        notes = list(getattr(exc, "__notes__", []) or [])
        notes.append(summary)
        combined.__notes__ = notes  # type: ignore[attr-defined]
    except Exception:
        pass
    return combined
