"""The Kubernetes API as ktlite uses it: a few JSON REST calls over one ``httpx.Client``.

Credentials come from the official ``kubernetes`` client's configuration loaders
(``KUBECONFIG`` / ``~/.kube/config`` with its TLS settings, tokens, client certificates and
exec plugins, or a pod's service account), so anything ``kubectl`` can reach, ktlite can.
The same client carries calls to pods through the API server's pod proxy, and tests
inject a transport in its place.

Requests go through httpx rather than the generated API classes: one client (and one
injectable transport) serves both the API and the streaming pod proxy, and ktlite does not
depend on the generated classes' signatures, which changed between client releases.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from ktlite.errors import (
    ConfigError,
    ControllerRequestError,
    KubernetesCredentialsError,
)

PATHS = {
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "Service": "/api/v1/namespaces/{ns}/services",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "Event": "/api/v1/namespaces/{ns}/events",
    "StatefulSet": "/apis/apps/v1/namespaces/{ns}/statefulsets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    # Knative Serving's Service shares its kind with the core one: keyed by this name instead
    "KnativeService": "/apis/serving.knative.dev/v1/namespaces/{ns}/services",
    "KnativeRevision": "/apis/serving.knative.dev/v1/namespaces/{ns}/revisions",
    "PodAutoscaler": "/apis/autoscaling.internal.knative.dev/v1alpha1/namespaces/{ns}/podautoscalers",
}
KNATIVE_API = "serving.knative.dev/v1"


def kind_of(obj: dict[str, Any]) -> str:
    """The key of ``PATHS`` an object is stored under (a Knative Service: "KnativeService")."""
    kind: str = obj["kind"]
    if obj.get("apiVersion") == KNATIVE_API:
        return "Knative" + kind
    return kind
_TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class KubeApiError(ControllerRequestError):
    """The API server refused a request, or could not be reached."""

    def __init__(self, message: str, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class ClusterInfo:
    """Which cluster a KubeApi talks to, for messages."""

    host: str
    context: str
    namespace: str
    in_cluster: bool


class _KubeAuth(httpx.Auth):
    """The kubeconfig's bearer token, read per request: exec plugins and service-account
    tokens rotate, and the configuration's refresh hook renews them."""

    def __init__(self, configuration: Any) -> None:
        self._configuration = configuration

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        # auth_settings() names the header and its value whatever key this client release
        # stores the token under ("authorization" in older ones, "BearerToken" in newer)
        for setting in self._configuration.auth_settings().values():
            if setting.get("in") == "header" and setting.get("value"):
                request.headers[setting["key"]] = setting["value"]
        if "authorization" not in request.headers and self._configuration.username \
                and self._configuration.password:
            request.headers["authorization"] = self._configuration.get_basic_auth_token()
        yield request

    def __repr__(self) -> str:
        return "_KubeAuth(<credentials hidden>)"


def _ssl_context(configuration: Any) -> ssl.SSLContext | bool:
    if not configuration.verify_ssl:
        return False
    ctx = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if configuration.cert_file:
        ctx.load_cert_chain(configuration.cert_file, configuration.key_file or None)
    return ctx


def load(kubeconfig: str | None = None, context: str | None = None,
         namespace: str | None = None) -> tuple[httpx.Client, ClusterInfo]:
    """An authenticated client for the cluster, and where it points.

    In a pod (service account mounted) the in-cluster configuration is used unless a
    kubeconfig is named (argument or KUBECONFIG); otherwise KUBECONFIG or ~/.kube/config.
    """
    try:
        from kubernetes import client as kclient
        from kubernetes import config as kconfig
    except ImportError as e:
        raise ConfigError("backend='kubernetes' needs the kubernetes client: "
                          "pip install 'ktlite[kubernetes]'") from e
    configuration = kclient.Configuration()
    in_cluster = kubeconfig is None and context is None and not os.environ.get("KUBECONFIG") \
        and "KUBERNETES_SERVICE_HOST" in os.environ \
        and os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token")
    try:
        if in_cluster:
            kconfig.load_incluster_config(client_configuration=configuration)
            context_name = "in-cluster"
            with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                default_ns = f.read().strip() or "default"
        else:
            kconfig.load_kube_config(config_file=kubeconfig, context=context,
                                     client_configuration=configuration, persist_config=False)
            contexts, current = kconfig.list_kube_config_contexts(config_file=kubeconfig)
            chosen = next((c for c in contexts if c["name"] == context), current) if context else current
            context_name = chosen["name"]
            default_ns = chosen.get("context", {}).get("namespace") or "default"
    except (kconfig.ConfigException, OSError, TypeError, ValueError) as e:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise KubernetesCredentialsError(f"could not load a Kubernetes configuration from {where}"
                          f"{f' (context {context!r})' if context else ''}: {e}; point KUBECONFIG at "
                          "your cluster's kubeconfig, or check `kubectl config get-contexts`") from e
    # TCP_NODELAY: a proxied call's body ends with a few bytes (its last chunk) that Nagle's
    # algorithm would hold back until the API server's delayed ACK, ~40 ms later
    transport = httpx.HTTPTransport(verify=_ssl_context(configuration), proxy=configuration.proxy or None,
                                    limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
                                    socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    http = httpx.Client(base_url=configuration.host, auth=_KubeAuth(configuration), timeout=_TIMEOUT,
                        transport=transport)
    info = ClusterInfo(host=configuration.host, context=context_name,
                       namespace=namespace or default_ns, in_cluster=in_cluster)
    return http, info


class KubeApi:
    """Namespaced CRUD for the object kinds ktlite creates; errors become KubeApiError."""

    def __init__(self, http: httpx.Client, namespace: str) -> None:
        self.http = http
        self.namespace = namespace

    def __repr__(self) -> str:
        return f"KubeApi(host={str(self.http.base_url)!r}, namespace={self.namespace!r})"

    def _path(self, kind: str, name: str | None = None) -> str:
        base = PATHS[kind].format(ns=self.namespace)
        return f"{base}/{name}" if name else base

    def request(self, method: str, path: str, *, what: str, ok_missing: bool = False,
                **kwargs: Any) -> httpx.Response | None:
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise KubeApiError(f"could not reach the Kubernetes API server at {self.http.base_url} to "
                               f"{what}: {e!r}; check the cluster is up and your kubeconfig") from e
        if resp.status_code == 404 and ok_missing:
            return None
        if resp.status_code >= 400:
            raise self._error(resp, what)
        return resp

    def _error(self, resp: httpx.Response, what: str) -> KubeApiError:
        try:
            body = resp.json()
            message, reason = body.get("message", resp.text), body.get("reason", "")
        except ValueError:
            message, reason = resp.text.strip()[:500], ""
        hint = {401: "your kubeconfig's credentials were refused; log in again",
                403: f"your account may not do this in namespace {self.namespace!r}; ask for RBAC "
                     "permissions on statefulsets, services, secrets, pods, pods/log, pods/proxy, "
                     "persistentvolumeclaims (serving: deployments, horizontalpodautoscalers, or Knative "
                     "services; docs/kubernetes.md)",
                404: f"does namespace {self.namespace!r} exist?"}.get(resp.status_code, "")
        return KubeApiError(f"Kubernetes API: {what} failed: HTTP {resp.status_code} "
                            f"{reason or resp.reason_phrase}: {message}" + (f"; {hint}" if hint else ""),
                            status=resp.status_code, reason=reason)

    # ---- objects ----------------------------------------------------------------------

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        resp = self.request("GET", self._path(kind, name), what=f"read {kind} {name}", ok_missing=True)
        return None if resp is None else resp.json()

    def list(self, kind: str, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("labelSelector", label_selector),
                                    ("fieldSelector", field_selector)) if v}
        resp = self.request("GET", self._path(kind), what=f"list {kind}s", params=params)
        assert resp is not None
        items: list[dict[str, Any]] = resp.json().get("items") or []
        return items

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind, name = kind_of(obj), obj["metadata"]["name"]
        resp = self.request("POST", self._path(kind), what=f"create {kind} {name}", json=obj)
        assert resp is not None
        return resp.json()

    def replace(self, obj: dict[str, Any], resource_version: str) -> dict[str, Any]:
        kind, name = kind_of(obj), obj["metadata"]["name"]
        body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": resource_version}}
        resp = self.request("PUT", self._path(kind, name), what=f"update {kind} {name}", json=body)
        assert resp is not None
        return resp.json()

    def patch(self, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        resp = self.request("PATCH", self._path(kind, name), what=f"patch {kind} {name}", json=patch,
                            headers={"content-type": "application/merge-patch+json"})
        assert resp is not None
        return resp.json()

    def delete(self, kind: str, name: str, propagation: str = "Background") -> bool:
        """Delete one object; False if it was already gone."""
        resp = self.request("DELETE", self._path(kind, name), what=f"delete {kind} {name}",
                            ok_missing=True, json={"propagationPolicy": propagation})
        return resp is not None

    def cluster_get(self, path: str, what: str) -> dict[str, Any] | None:
        """A cluster-scoped object (a CustomResourceDefinition, an APIService) at ``path``, or
        None when it is not there or this account may not read it."""
        try:
            resp = self.request("GET", path, what=what, ok_missing=True)
        except KubeApiError as e:
            if e.status == 403:
                return None
            raise
        return None if resp is None else resp.json()

    # ---- pods ---------------------------------------------------------------------------

    def pod_log(self, name: str, *, tail: int | None = None, previous: bool = False) -> str:
        params: dict[str, Any] = {"container": "ktlite"}
        if tail:
            params["tailLines"] = tail
        if previous:
            params["previous"] = "true"
        with contextlib.suppress(KubeApiError):
            resp = self.request("GET", f"{self._path('Pod', name)}/log", what=f"read the log of pod {name}",
                                ok_missing=True, params=params)
            text = "" if resp is None else resp.text
            # for a container the runtime no longer has, the kubelet answers 200 with a line of
            # its own, "unable to retrieve container logs for containerd://<id>" (or docker://,
            # cri-o://...): that is no log, and must not hide another container's real one
            body = text.strip()
            if body.startswith("unable to retrieve container logs for ") and "\n" not in body:
                return ""
            return text
        return ""

    def follow_log(self, name: str, tail: int | None = None) -> Iterator[str]:
        """Lines of a pod's log as they are written, until the pod's container ends."""
        params: dict[str, Any] = {"container": "ktlite", "follow": "true"}
        if tail:
            params["tailLines"] = tail
        path = f"{self._path('Pod', name)}/log"
        try:
            with self.http.stream("GET", path, params=params,
                                  timeout=httpx.Timeout(30.0, connect=10.0, read=None)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise self._error(resp, f"follow the log of pod {name}")
                yield from resp.iter_lines()
        except httpx.HTTPError as e:
            raise KubeApiError(f"lost the log stream of pod {name}: {e!r}") from e

    def proxy_url(self, pod: str, port: int) -> str:
        """The URL under which the API server proxies HTTP to ``pod``:``port``."""
        base = str(self.http.base_url).rstrip("/")
        return f"{base}{self._path('Pod', pod)}:{port}/proxy"
