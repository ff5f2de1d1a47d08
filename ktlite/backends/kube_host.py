"""What the Kubernetes backend's parts (:mod:`~ktlite.backends.kube_served`, :mod:`~ktlite.backends.kube_statefulsets`,
:mod:`~ktlite.backends.kube_teardown`,
:mod:`~ktlite.backends.kube_served_status`,
:mod:`~ktlite.backends.kube_readiness`) use of the backend they are mixed into.

For type checking only: the parts are mixed into
:class:`~ktlite.backends.kubernetes.KubernetesBackend`, which has all of this, and they
cannot import it (it imports them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import httpx

from ktlite.backends.kube_api import ClusterInfo, KubeApi
from ktlite.backends.kube_diagnose import PodProblem
from ktlite.specs.deployment_spec import DeploymentSpec


class KubeHost(Protocol):
    name: str
    _http: httpx.Client | None
    _info: ClusterInfo | None
    _clock: Callable[[], float]
    _sleep: Callable[[float], None]

    @property
    def namespace(self) -> str: ...
    def _connect(self) -> tuple[httpx.Client, ClusterInfo]: ...
    def _api(self) -> KubeApi: ...
    def _say(self, text: str) -> None: ...
    def _announce(self, api: KubeApi) -> None: ...
    @staticmethod
    def _with_settings(spec: DeploymentSpec) -> DeploymentSpec: ...
    @staticmethod
    def _image(spec: DeploymentSpec) -> str: ...
    @staticmethod
    def _install() -> str: ...
    def _failed(
        self,
        api: KubeApi,
        name: str,
        error: BaseException,
        created: list[tuple[str, str]] | None,
        served: bool = False,
    ) -> BaseException: ...
    def _ensure(
        self, api: KubeApi, obj: dict[str, Any], created: list[tuple[str, str]]
    ) -> None: ...
    def _apply_policy(
        self, api: KubeApi, policy: dict[str, Any], created: list[tuple[str, str]]
    ) -> None: ...
    def _remove_stale_parts(self, api: KubeApi, name: str, keep: set[str]) -> None: ...
    def _wait_gone(self, api: KubeApi, kind: str, name: str, timeout: float) -> None: ...
    def _teardown_served(self, api: KubeApi, name: str) -> bool: ...
    # kube_readiness.PodReadiness's, which kube_served uses too
    def _serving(self, api: KubeApi, pod: dict[str, Any], answering: set[str]) -> bool: ...
    def _scaling_up(self, api: KubeApi, pod: dict[str, Any]) -> bool: ...
    def _claims_problem(self, api: KubeApi, pod: dict[str, Any]) -> str | None: ...
    def _explain(self, api: KubeApi, spec: DeploymentSpec, problem: PodProblem) -> str: ...
