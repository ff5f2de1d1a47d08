"""The Kubernetes API as ktlite uses it: a few JSON REST calls over one ``httpx.Client``.

Credentials come from ``ktlite.backends.kubeconfig`` (``KUBECONFIG`` / ``~/.kube/config``
with its TLS settings, tokens, client certificates and exec plugins, or a pod's service
account, read as kubectl reads them; an ``auth-provider`` user through the official
``kubernetes`` client's loader), so anything ``kubectl`` can reach, ktlite can.
The same client carries calls to pods through the API server's pod proxy, and tests
inject a transport in its place.

Requests go through httpx rather than the generated API classes: one client (and one
injectable transport) serves both the API and the streaming pod proxy, and ktlite does not
depend on the generated classes' signatures, which changed between client releases.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import ssl
import tempfile
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from ktlite.backends import kubeconfig
from ktlite.errors import ControllerRequestError, KubernetesCredentialsError
from ktlite.logconfig import http_hook
from ktlite_wire import privatefiles

logger = logging.getLogger(__name__)

PATHS = {
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "Service": "/api/v1/namespaces/{ns}/services",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "Event": "/api/v1/namespaces/{ns}/events",
    "StatefulSet": "/apis/apps/v1/namespaces/{ns}/statefulsets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
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
PAGE = 500  # objects per LIST answer (kubectl's chunk size): a LIST of 1,000s of pods pages
LIST_ATTEMPTS = 3  # a list whose page token expired (410) starts again, this many times at most


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
    """The credential's Authorization header, asked per request: exec plugins and
    service-account tokens rotate."""

    def __init__(self, authorization: Callable[[], str | None]) -> None:
        self._authorization = authorization

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        try:
            value = self._authorization()
        except (kubeconfig.CredentialsError, OSError) as e:  # a plugin failed, a token file went
            raise KubernetesCredentialsError(
                f"could not renew the Kubernetes credentials: {e}"
            ) from e
        if value:
            request.headers["authorization"] = value
        yield request

    def __repr__(self) -> str:
        return "_KubeAuth(<credentials hidden>)"


def _ssl_context(creds: kubeconfig.Credentials) -> ssl.SSLContext:
    """Trust the kubeconfig's CA (else the system's), present its client certificate; with
    insecure-skip-tls-verify, trust any server (and still present the certificate)."""
    ctx = ssl.create_default_context(
        cafile=creds.ca_file, cadata=creds.ca_pem.decode() if creds.ca_pem else None
    )
    if not creds.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if creds.cert_file or creds.cert_pem:
        if creds.cert_pem is None:
            ctx.load_cert_chain(creds.cert_file or "", creds.key_file or None)
        else:  # the ssl module loads certificates from files only: a private one, gone at once
            with tempfile.TemporaryDirectory(prefix="ktlite-cert-") as tmp:
                cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
                for path, data in ((cert, creds.cert_pem), (key, creds.key_pem or b"")):
                    with privatefiles.create_new(path) as f:
                        f.write(data)
                ctx.load_cert_chain(cert, key if creds.key_pem else None)
    return ctx


def load(
    kubeconfig_path: str | None = None, context: str | None = None, namespace: str | None = None
) -> tuple[httpx.Client, ClusterInfo]:
    """An authenticated client for the cluster, and where it points.

    In a pod (service account mounted) the in-cluster configuration is used unless a
    kubeconfig is named (argument or KUBECONFIG); otherwise KUBECONFIG or ~/.kube/config
    (``ktlite.backends.kubeconfig`` reads them; the ``kubernetes`` package is not imported).
    """
    creds = kubeconfig.load(kubeconfig_path, context)
    try:
        verify = _ssl_context(creds)
    except (OSError, ValueError) as e:  # ssl.SSLError too
        raise KubernetesCredentialsError(
            f"the TLS settings of Kubernetes context {creds.context!r} do not load: {e}; check its "
            "certificate-authority and client-certificate/client-key"
        ) from e
    # TCP_NODELAY: a proxied call's body ends with a few bytes (its last chunk) that Nagle's
    # algorithm would hold back until the API server's delayed ACK, ~40 ms later
    transport = httpx.HTTPTransport(
        verify=verify,
        proxy=creds.proxy,
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
    )
    http = httpx.Client(
        base_url=creds.host,
        auth=_KubeAuth(creds.authorization),
        timeout=_TIMEOUT,
        transport=transport,
        event_hooks={"response": [http_hook(logger)]},  # each request at DEBUG, never a header
    )
    info = ClusterInfo(
        host=creds.host,
        context=creds.context,
        namespace=namespace or creds.namespace,
        in_cluster=creds.in_cluster,
    )
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

    def request(
        self, method: str, path: str, *, what: str, ok_missing: bool = False, **kwargs: Any
    ) -> httpx.Response | None:
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise KubeApiError(
                f"could not reach the Kubernetes API server at {self.http.base_url} to "
                f"{what}: {e!r}; check the cluster is up and your kubeconfig"
            ) from e
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
        hint = {
            401: "your kubeconfig's credentials were refused; log in again",
            403: f"your account may not do this in namespace {self.namespace!r}; ask for RBAC "
            "permissions on statefulsets, services, secrets, pods, pods/log, pods/proxy, "
            "persistentvolumeclaims (serving: deployments, horizontalpodautoscalers, or Knative "
            "services; docs/kubernetes.md)",
            404: f"does namespace {self.namespace!r} exist?",
        }.get(resp.status_code, "")
        return KubeApiError(
            f"Kubernetes API: {what} failed: HTTP {resp.status_code} "
            f"{reason or resp.reason_phrase}: {message}" + (f"; {hint}" if hint else ""),
            status=resp.status_code,
            reason=reason,
        )

    # ---- objects ----------------------------------------------------------------------

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        resp = self.request(
            "GET", self._path(kind, name), what=f"read {kind} {name}", ok_missing=True
        )
        return None if resp is None else resp.json()

    def _pages(self, kind: str, params: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        """Every object of a LIST, read ``PAGE`` at a time (``limit``/``continue``, as kubectl
        reads), and the list's ``resourceVersion`` (every page's: one snapshot). A token the
        API server has expired meanwhile (410) starts the list again, a few times at most."""
        what, attempt = f"list {kind}s", 0
        while True:
            attempt += 1
            items: list[dict[str, Any]] = []
            token = ""
            try:
                while True:
                    page = {**params, "limit": PAGE, **({"continue": token} if token else {})}
                    resp = self.request("GET", self._path(kind), what=what, params=page)
                    assert resp is not None
                    body = resp.json()
                    items += body.get("items") or []
                    meta = body.get("metadata") or {}
                    token = meta.get("continue") or ""
                    if not token:
                        return items, str(meta.get("resourceVersion", ""))
            except KubeApiError as e:
                if e.status != 410 or not token or attempt == LIST_ATTEMPTS:
                    raise
                logger.info("%s: its page token expired after %d items; again", what, len(items))

    def list_at(
        self, kind: str, label_selector: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """The objects, and the list's ``resourceVersion``: where a watch of them starts."""
        return self._pages(kind, {"labelSelector": label_selector} if label_selector else {})

    def list(
        self, kind: str, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        params = {
            k: v
            for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector))
            if v
        }
        return self._pages(kind, params)[0]

    @contextlib.contextmanager
    def watch(
        self,
        kind: str,
        label_selector: str | None,
        resource_version: str,
        timeout_s: int,
        stall_s: float,
    ) -> Iterator[Iterator[dict[str, Any]]]:
        """The changes to ``kind`` after ``resource_version``, one event (``{"type": ...,
        "object": ...}``) at a time, with bookmarks, until the API server ends the watch after
        ``timeout_s``. ``stall_s``: the longest silence before the watch counts as stalled
        (``KubeApiError``; client libraries' watches are known to stall without a word).
        A too-old ``resource_version`` is a ``KubeApiError`` with status 410 (either as the HTTP
        status or as an ERROR event, which API servers send both ways)."""
        params: dict[str, Any] = {
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": timeout_s,
            "allowWatchBookmarks": "true",
        }
        if label_selector:
            params["labelSelector"] = label_selector
        what = f"watch {kind}s"
        timeout = httpx.Timeout(30.0, connect=10.0, read=stall_s)
        try:
            with self.http.stream("GET", self._path(kind), params=params, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise self._error(resp, what)
                yield _events(resp.iter_lines(), what)
        except httpx.HTTPError as e:
            raise KubeApiError(
                f"the watch of {kind}s broke ({e!r}): nothing for {stall_s:g}s, or the "
                "connection dropped"
            ) from e

    def delete_collection(self, kind: str, label_selector: str) -> int:
        """Delete every ``kind`` that ``label_selector`` matches, in one request; how many
        there were."""
        resp = self.request(
            "DELETE",
            self._path(kind),
            what=f"delete the {kind}s with labels {label_selector}",
            params={"labelSelector": label_selector},
            json={"propagationPolicy": "Background"},
        )
        assert resp is not None
        try:
            return len(resp.json().get("items") or [])
        except ValueError:  # an API server that answers a Status without the items
            return 0

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind, name = kind_of(obj), obj["metadata"]["name"]
        resp = self.request("POST", self._path(kind), what=f"create {kind} {name}", json=obj)
        assert resp is not None
        body: dict[str, Any] = resp.json()
        return body

    def replace(self, obj: dict[str, Any], resource_version: str) -> dict[str, Any]:
        kind, name = kind_of(obj), obj["metadata"]["name"]
        sent = {**obj, "metadata": {**obj["metadata"], "resourceVersion": resource_version}}
        resp = self.request("PUT", self._path(kind, name), what=f"update {kind} {name}", json=sent)
        assert resp is not None
        body: dict[str, Any] = resp.json()
        return body

    def patch(self, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        resp = self.request(
            "PATCH",
            self._path(kind, name),
            what=f"patch {kind} {name}",
            json=patch,
            headers={"content-type": "application/merge-patch+json"},
        )
        assert resp is not None
        body: dict[str, Any] = resp.json()
        return body

    def delete(self, kind: str, name: str, propagation: str = "Background") -> bool:
        """Delete one object; False if it was already gone."""
        resp = self.request(
            "DELETE",
            self._path(kind, name),
            what=f"delete {kind} {name}",
            ok_missing=True,
            json={"propagationPolicy": propagation},
        )
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
            resp = self.request(
                "GET",
                f"{self._path('Pod', name)}/log",
                what=f"read the log of pod {name}",
                ok_missing=True,
                params=params,
            )
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
            with self.http.stream(
                "GET", path, params=params, timeout=httpx.Timeout(30.0, connect=10.0, read=None)
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise self._error(resp, f"follow the log of pod {name}")
                yield from resp.iter_lines()
        except httpx.HTTPError as e:
            raise KubeApiError(f"lost the log stream of pod {name}: {e!r}") from e

    def proxy_url(self, pod: str, port: int, https: bool = False) -> str:
        """The URL under which the API server proxies HTTP to ``pod``:``port`` (``https``: to
        a pod serving TLS, the ``https:POD:PORT`` form; the API server does not verify the
        pod's certificate)."""
        base = str(self.http.base_url).rstrip("/")
        return f"{base}{self._path('Pod', ('https:' if https else '') + pod)}:{port}/proxy"


def _events(lines: Iterator[str], what: str) -> Iterator[dict[str, Any]]:
    """A watch's JSON lines as events; an ERROR event becomes ``KubeApiError`` (410: expired)."""
    for line in lines:
        if not line.strip():
            continue
        try:
            event: dict[str, Any] = json.loads(line)
        except ValueError as e:
            raise KubeApiError(f"{what}: the API server sent {line[:200]!r}, not JSON") from e
        if event.get("type") == "ERROR":
            status = event.get("object") or {}
            raise KubeApiError(
                f"Kubernetes API: {what} failed: {status.get('code')} "
                f"{status.get('reason', '')}: {status.get('message', '')}",
                status=status.get("code"),
                reason=status.get("reason", ""),
            )
        yield event
