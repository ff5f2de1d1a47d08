"""The backend boundary: start, find and stop N pods; report how to reach them.

A backend never sees user code or calls: only a :class:`DeploymentSpec`. It answers with
:class:`PodEndpoint` s; everything else (pushing code, calls, errors) is backend-agnostic.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ktlite.config import private_home
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire import privatefiles

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's from Python 3.11


@dataclass(frozen=True)
class PodEndpoint:
    """One pod: its name, ordinal, the URL the client uses, the URL peers use, and its IP;
    ``incarnation`` changes when the pod is replaced or its server restarts (it then has no
    code until pushed again)."""

    name: str
    ordinal: int
    url: str
    peer_url: str
    ip: str
    incarnation: str = ""


@dataclass
class Applied:
    """A running deployment as the backend reports it."""

    name: str
    backend: str
    endpoints: list[PodEndpoint]
    token: str = field(repr=False)
    master_port: int
    restarted: list[int] = field(default_factory=list)  # ordinals whose pod is new
    same_host: bool = False  # pods share this machine's /dev/shm (local backend)
    http: Any = field(default=None, repr=False)  # an httpx.Client that reaches ``url`` s (a proxy)
    spec_hash: str = ""  # what the pods were made from: another spec means another deployment
    autoscale: dict[str, Any] | None = None  # an autoscaled deployment's AutoscaleConfig fields


@dataclass(frozen=True)
class Plan:
    """What deploying would do, touching nothing: commands (local) or manifests (kubernetes)."""

    backend: str
    name: str
    commands: list[str] = field(default_factory=list)
    manifests: list[dict[str, Any]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"# ktlite plan for {self.name!r} on backend {self.backend!r}"]
        lines += self.commands
        if self.manifests:
            lines.append(self.yaml())
        return "\n".join(lines)

    def yaml(self) -> str:
        """The manifests as one multi-document YAML stream (JSON if PyYAML is missing)."""
        try:
            import yaml
        except ImportError:
            import json

            return "\n---\n".join(json.dumps(m, indent=2) for m in self.manifests)
        return yaml.safe_dump_all(self.manifests, sort_keys=False, default_flow_style=False)


def read_state(directory: Path) -> dict[str, Any] | None:
    """A deployment's ``state.json`` in ``directory``, or None when absent or unreadable."""
    try:
        with open(directory / "state.json") as f:
            state: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    return state


def write_state(directory: Path, state: dict[str, Any]) -> None:
    """Write ``state.json`` atomically, readable by this user only (it holds the token);
    ``directory`` is under ``$KTLITE_HOME``, which is made private first."""
    private_home()
    privatefiles.make_dir(directory)
    privatefiles.write_file(directory / "state.json", json.dumps(state))


class Backend(ABC):
    name: str = "base"
    tls_default: bool = True  # Compute(tls=None) serves TLS (docs/tls.md); local: loopback, off

    def encrypts(self, spec: DeploymentSpec) -> bool:
        """Whether ``spec``'s pods serve TLS pinned to the deployment's certificate (and their
        URLs are ``https://``): ``Compute(tls=...)``, else this backend's default."""
        return self.tls_default if spec.pod.tls is None else spec.pod.tls

    @classmethod
    def shared(cls, namespace: str | None = None, kubeconfig: str | None = None) -> Self:
        """This process's one instance of the backend (its connections and child processes);
        ``namespace`` and ``kubeconfig`` pick a cluster's, where the backend has any."""
        instance = cls.__dict__.get("_instance")
        if not isinstance(instance, cls):
            instance = cls()
            setattr(cls, "_instance", instance)  # noqa: B010  (one per class, not inherited)
        return instance

    @abstractmethod
    def plan(self, spec: DeploymentSpec) -> Plan:
        """Pure: what ``apply`` would create."""

    @abstractmethod
    def apply(self, spec: DeploymentSpec, token: str) -> Applied:
        """Make N ready pods for ``spec``, reusing those whose pod spec did not change."""

    @abstractmethod
    def lookup(self, name: str) -> Applied | None:
        """The running deployment called ``name``, or None."""

    @abstractmethod
    def teardown(self, name: str, timeout: float = 30.0, volumes: bool = False) -> bool:
        """Stop everything the deployment created (its volumes only if asked); True if
        something was there."""

    @abstractmethod
    def list(self) -> list[dict[str, Any]]:
        """Deployments this backend can see."""

    # ---- autoscaled deployments (spec.autoscale is set; see ktlite.modes.serving) ----------------
    # A backend that runs them has the methods of ktlite.backends.capabilities.Serving (and
    # ClientScaling where ktlite's own autoscaler scales them).
    # Their replicas are each a world of one pod (RANK 0, WORLD_SIZE 1), started with
    # KTLITE_POD_ORDINAL=0 and KTLITE_LAUNCH_FILE naming where write_launch() keeps the current
    # launch, so a replica the autoscaler starts later loads the code before it is ready
    # (GET /health?ready=1 answers 503 until then). apply() returns the replicas that run, by
    # ordinal (local: the pod's own; Kubernetes: their order by name), without waiting for
    # the readiness the first launch gives.

    def where(self) -> str:
        """Where its pods run, for people: the backend's name (Kubernetes: and the namespace)."""
        return self.name

    def store_handoff(self) -> dict[str, Any] | None:
        """What each pod is told about the data store where the store is itself a pod the
        deployment's pods reach (Kubernetes); None where ranks reach the caller's own store."""
        return None

    def scaling_status(self, name: str) -> dict[str, Any] | None:
        """The cluster autoscaler's view (desired and current replicas, its last decision and
        why); None where ktlite's own autoscaler decides (its decisions are in ktlite.modes.serving)."""
        return None

    def logs(
        self, name: str, ordinal: int | None = None, follow: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        """Lines of the pods' logs (all pods, or pod ``ordinal``), prefixed with the pod."""
        raise NotImplementedError(f"{type(self).__name__} does not serve pod logs")
