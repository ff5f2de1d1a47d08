"""Pods as the Kubernetes API returns them: their ordinal, address, template hash and
readiness, and the error a pod's fatal problem becomes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_tls
from ktlite.backends.kube_diagnose import PodProblem
from ktlite.errors import (
    DeployError,
    ImagePullError,
    PodTerminatedError,
    ResourceNotAvailableError,
    SecretNotFound,
    StartupError,
)


def url(ip: str, port: int, https: bool = False) -> str:
    """A pod's address as a URL (``https``: it serves TLS, :mod:`~ktlite.backends.kube_tls`)."""
    scheme = "https" if https else "http"
    return f"{scheme}://[{ip}]:{port}" if ":" in ip else f"{scheme}://{ip}:{port}"


def urls(pod: dict[str, Any], port: int, proxy: Callable[..., str] | None) -> tuple[str, str]:
    """(the URL other pods reach ``pod`` at, the URL the caller does): the same in the cluster
    (``proxy`` None), else the API server's pod proxy (``proxy``: ``KubeApi.proxy_url``).
    ``https`` ones where the pod serves TLS (:func:`~ktlite.backends.kube_tls.serves_tls`)."""
    secure = kube_tls.serves_tls(pod)
    peer = url(pod["status"].get("podIP", ""), port, https=secure)
    return peer, peer if proxy is None else proxy(pod["metadata"]["name"], port, https=secure)


def ordinal(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["name"].rsplit("-", 1)[1])


def first_ordinal(sts: dict[str, Any]) -> int:
    return int((sts["spec"].get("ordinals") or {}).get("start", 0))


def match(sts: dict[str, Any]) -> str:
    """A label selector for the pods of ``sts``."""
    return ",".join(f"{k}={v}" for k, v in sts["spec"]["selector"]["matchLabels"].items())


def ordinal_hashes(statefulsets: list[dict[str, Any]]) -> dict[int, str]:
    """ordinal → the pod hash its StatefulSet's template asks for."""
    want: dict[int, str] = {}
    for sts in statefulsets:
        start = first_ordinal(sts)
        for ordinal in range(start, start + sts["spec"].get("replicas", 0)):
            want[ordinal] = pod_hash(sts["spec"]["template"]) or ""
    return want


def pod_hash(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata", {})
    value: str | None = (meta.get("annotations") or {}).get(km.HASH_ANNOTATION)
    return value


def incarnation(pod: dict[str, Any]) -> str:
    """The pod's uid, IP and container restarts: any change means a server without our code."""
    status = pod.get("status") or {}
    restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
    return f"{pod['metadata'].get('uid', '')}/{status.get('podIP', '')}/{restarts}"


def is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


_PROBLEM_ERRORS: dict[str, type[DeployError]] = {
    "image_pull": ImagePullError,
    "unschedulable": ResourceNotAvailableError,
    "secret": SecretNotFound,
    "setup": StartupError,
    "crash": StartupError,
    "config": StartupError,
}


def deploy_error(problem: PodProblem, message: str) -> DeployError:
    """The error a pod's fatal problem fails the deploy with (Kubetorch's names)."""
    if problem.kind in ("oom", "evicted", "failed"):
        return PodTerminatedError(message, pod_name=problem.pod, reason=problem.reason)
    return _PROBLEM_ERRORS.get(problem.kind, DeployError)(message)
