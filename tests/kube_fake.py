"""An in-memory fake Kubernetes API server for tests, usable as an ``httpx`` transport::

    fake = FakeKube(token="t", pod_behavior=lambda pod: ready())
    client = httpx.Client(transport=fake, base_url="https://fake-apiserver",
                          headers={"Authorization": "Bearer t"})

What it simulates, with the JSON shapes a v1.31 API server returns:

* Namespaced pods, services, secrets, persistentvolumeclaims, events (``/api/v1``),
  statefulsets (``/apis/apps/v1``) and networkpolicies (``/apis/networking.k8s.io/v1``; stored,
  not enforced, as on a cluster whose network plugin ignores them): list (``labelSelector``
  with ``=``, ``==``, ``!=``, ``k``, ``!k``, ``in``, ``notin``; ``fieldSelector`` on dotted
  paths), create (``generateName`` too), get, replace, merge / strategic-merge / (simplified) server-side-apply patch, delete
  (``propagationPolicy``, ``gracePeriodSeconds``, ``preconditions``) and deletecollection.
  ``Status`` error bodies, ``resourceVersion`` (optimistic concurrency on PUT/PATCH), ``uid``,
  ``creationTimestamp``, ``generation``, ``*List`` kinds whose items carry no kind/apiVersion,
  a few defaults (pod spec, service clusterIP, secret stringData) and the validations backends
  most often trip on (names, label values, containers, StatefulSet selector and immutable spec).
* Deployments (``/apis/apps/v1``; their ReplicaSets folded in: pods ``NAME-<hash>-<xxxxx>`` owned by
  the Deployment, ``spec.replicas`` followed, the newest removed first, a changed template rolled
  with maxUnavailable 0), HorizontalPodAutoscalers (``/apis/autoscaling/v2``; stored: no metrics,
  tests play the autoscaler by patching replicas and ``set_status``), and with ``knative=True``
  Knative Services (``/apis/serving.knative.dev/v1``, its CRD readable; revisions run as pods of
  the template) and an Available custom metrics APIService with ``custom_metrics=True``.
* A StatefulSet controller (OrderedReady or Parallel; RollingUpdate one pod at a time from the
  highest ordinal with ``partition``, or OnDelete; PVCs from volumeClaimTemplates; adoption) and
  a garbage collector that follows ``ownerReferences``.
* Scheduler and kubelet, scripted per pod: ``pod_behavior(pod) -> PodScript``; the helpers
  below (``ready()``, ``unschedulable()``, ``crash_loop()``...) build the pod ``status`` exactly
  as a real cluster reports it, plus the events and log text that go with it. A script may be a
  list of ``(after_seconds, PodState)`` steps timed from pod creation on the injected clock.
* ServiceAccounts, Roles and RoleBindings (stored), and RBAC for the tokens
  ``service_account_token`` issues (``kube_rbac``: a Role's ``resourceNames`` hold); the
  fake's own token is an administrator's.
* Watches of any collection (``kube_fake_watch``: bookmarks, 410 for a compacted version, the
  server's ``timeoutSeconds``) and a timeline of actions at clock times.
* Pod logs (``tailLines``, ``limitBytes``, ``previous``, ``container``, ``follow``) served with
  the kubelet's rules for which container's log a request gets, pod proxy delegated to
  ``proxy_handlers[(pod, port)]``, bearer-token auth, error injection, request recording.
* LIST paging (``limit``/``continue`` over a snapshot, 410 when expired: ``kube_fake_paging``).

What it does not do: other resources or subresources
(``/status`` is GET only), ClusterRoles, admission beyond the checks above, JSON patch (RFC 6902),
field managers (apply is a strategic merge that may create), the full strategic-merge-patch
rules (lists merge by ``name``/``mountPath``/``containerPort``/``port`` only), ControllerRevisions,
finalizers (Foreground/Orphan deletion completes at once; a claim deleted while a pod mounts
it stays Terminating until no pod does, as pvc-protection has it), init containers, pod spec
immutability, a pod restarting after its image is patched. Nothing runs in the background:
every request (and ``objects``/``get``) first brings pods and controllers up to the clock.

This module holds the transport and its routing; the parts are mixed in or imported:
``kube_fake_api`` (resources, Status errors, selectors, merge patches), ``kube_fake_pods``
(pod states and scripts), ``kube_fake_store`` (the storage verbs), ``kube_fake_checks``
(validation and defaults), ``kube_fake_statefulsets`` (the StatefulSet controller, kubelet
and claims), ``kube_fake_replicas`` (Deployments, Knative, HPAs), ``kube_fake_proxy``,
``kube_fake_logs``, ``kube_fake_watch`` and ``kube_fake_controls`` (what tests ask directly).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

import httpx
import kube_fake_paging
import kube_fake_watch
import kube_rbac
from kube_fake_api import (  # noqa: F401 (re-exported)
    _DNS1035,
    _DNS1123,
    _HAS_STATUS,
    _LABEL_VALUE,
    _MERGE_KEYS,
    _NODES,
    _PLURALS,
    _RESOURCES,
    _RETURNS_OBJECT,
    _STS_MUTABLE,
    _UNSCHEDULABLE,
    KNATIVE_CRD,
    MAX_SECRET_BYTES,
    METRICS_APISERVICE,
    ApiError,
    Obj,
    ProxyHandler,
    RecordedRequest,
    _bad,
    _conflict,
    _details,
    _Failure,
    _group,
    _hash,
    _healthy,
    _invalid,
    _json,
    _labels,
    _merge_key,
    _normalize_image,
    _not_allowed,
    _not_found,
    _plural,
    _qos,
    _qualified,
    _sha,
    _unknown,
    field_selector_matches,
    label_selector_matches,
    merge_patch,
    status_body,
)
from kube_fake_checks import Checks
from kube_fake_controls import Conveniences
from kube_fake_logs import Logs
from kube_fake_pods import (  # noqa: F401 (re-exported)
    PodBehavior,
    PodCtx,
    PodScript,
    PodState,
    _backoff,
    _cond,
    _conditions,
    _containers,
    _no_events,
    _pod_status,
    _PodMeta,
    _pull_error,
    _pull_failure,
    _started_events,
    _steps,
    _terminated,
    container_creating,
    crash_loop,
    create_container_config_error,
    err_image_pull,
    image_pull_backoff,
    oom_killed,
    pending,
    ready,
    running_not_ready,
    terminated_again,
    terminated_error,
    unschedulable,
)
from kube_fake_proxy import Proxies
from kube_fake_replicas import ReplicaControllers
from kube_fake_statefulsets import StatefulSetController
from kube_fake_store import Storage


class FakeClock:
    """A clock for ``FakeKube(clock=...)`` that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeKube(
    Conveniences,
    Storage,
    Checks,
    StatefulSetController,
    ReplicaControllers,
    Logs,
    Proxies,
    httpx.BaseTransport,
):
    def __init__(
        self,
        *,
        token: str | None = None,
        namespaces: Sequence[str] = ("default",),
        pod_behavior: PodBehavior | None = None,
        clock: Callable[[], float] = time.monotonic,
        pod_termination_seconds: float = 0.0,
        follow_idle_timeout: float = 0.0,
        pvc_bind_seconds: float = 0.0,
        knative: bool = False,
        custom_metrics: bool = False,
    ) -> None:
        """``pod_behavior`` scripts each new pod (None: ``ready()`` at once); a deleted pod
        stays Terminating for min(its grace period, ``pod_termination_seconds``) on ``clock``;
        a ``follow=true`` log stream ends after ``follow_idle_timeout`` real seconds without
        new text, or when its pod goes away or its container stops running. A claim binds
        ``pvc_bind_seconds`` after it is created (one whose storage class contains
        ``does-not-exist`` never does); until then pods that mount it are Unschedulable, and
        their scripts start when it binds. ``knative``: Knative Serving's CRD exists and its
        Services are served (and run, see ``_reconcile_ksvc``); ``custom_metrics``: an
        Available APIService for the custom metrics API exists. Both may be switched later."""
        self.knative = knative
        self.custom_metrics = custom_metrics
        self.knative_scale: dict[
            tuple[str, str], int
        ] = {}  # (ns, name) -> replicas Knative's autoscaler wants
        self._revisions: dict[
            str, dict[str, int]
        ] = {}  # ksvc uid -> template hash -> revision number
        self.token = token
        self.accounts = kube_rbac.ServiceAccountTokens()
        self.namespaces = tuple(namespaces)
        self.pod_behavior = pod_behavior
        self.clock = clock
        self.pod_termination_seconds = pod_termination_seconds
        self.follow_idle_timeout = follow_idle_timeout
        self.pvc_bind_seconds = pvc_bind_seconds
        self._pvc_bind_at: dict[tuple[str, str], float] = {}  # claims waiting for a volume
        self.requests: list[RecordedRequest] = []
        self.proxy_handlers: dict[tuple[str, int], ProxyHandler] = {}
        self.lock = threading.RLock()
        self._store: dict[tuple[str, str, str], Obj] = {}  # (resource, namespace, name)
        self._pods: dict[str, _PodMeta] = {}  # by uid
        self._overrides: dict[tuple[str, str], PodScript] = {}
        self._logs: dict[tuple[str, str, str | None, bool], str] = {}
        self._failures: list[_Failure] = []
        self._current_rev: dict[str, str] = {}  # StatefulSet uid -> status.currentRevision
        self._rv = 1000
        self._counter = itertools.count(5)  # pod IPs and nodes
        self._seq = itertools.count(2)  # service IPs, event names
        self._t0, self._wall0 = clock(), time.time()
        self._ns_uids = {ns: str(uuid.uuid4()) for ns in self.namespaces}
        self.watches = kube_fake_watch.Watches(self)  # watch=true, and a timeline for tests
        self.pages = kube_fake_paging.Pages()  # limit/continue; tests set pages.max_page

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        content = request.read()
        path, query = request.url.path, dict(request.url.params)
        try:
            body = json.loads(content) if content else None
        except ValueError:
            body = None
        with self.lock:
            self.requests.append(
                RecordedRequest(request.method, path, query, body, dict(request.headers), content)
            )
            auth = request.headers.get("authorization")
            if self.token is not None and auth != f"Bearer {self.token}":
                account = self.accounts.who(auth)  # a ServiceAccount's token: RBAC decides
                live = account and self._store.get(("serviceaccounts", account[0], account[1]))
                if not account or not live or live["metadata"]["uid"] != account[2]:
                    return _json(401, status_body(401, "Unauthorized", "Unauthorized"))
                denied = kube_rbac.forbidden(self._store, account, request.method, path)
                if denied is not None:
                    return _json(403, status_body(403, "Forbidden", denied))
            self.watches.read_timeout = (request.extensions.get("timeout") or {}).get("read")
            for failure in self._failures:
                if failure.method in ("*", request.method) and failure.path.search(path):
                    failure.times -= 1
                    if failure.times <= 0:
                        self._failures.remove(failure)
                    return _json(failure.body["code"], copy.deepcopy(failure.body))
        try:
            if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/proxy(/.*)?", path):
                return self._proxy(request, m[1], m[2], m[3] or "/")
            if m := re.fullmatch(
                r"/api/v1/namespaces/([^/]+)/services/([^/:]+)(?::[^/]+)?/proxy(/.*)?", path
            ):
                with self.lock:
                    return self._activator(request, m[1], m[2])
            with self.lock:
                self._tick()
                response = self._route(
                    request.method, path, query, content, request.headers.get("content-type", "")
                )
                self._tick()
                return response
        except ApiError as err:
            return err.response()

    def _route(
        self, method: str, path: str, query: dict[str, str], content: bytes, ctype: str
    ) -> httpx.Response:
        if path == "/version" and method == "GET":
            return _json(
                200,
                {"major": "1", "minor": "31", "gitVersion": "v1.31.0", "platform": "linux/amd64"},
            )
        if m := re.fullmatch(
            r"/apis/(apiextensions\.k8s\.io|apiregistration\.k8s\.io)/v1/"
            r"(customresourcedefinitions|apiservices)/([^/]+)",
            path,
        ):
            return self._cluster_object(method, m[2], m[3])
        m = re.fullmatch(
            r"/(?:api/v1|apis/([^/]+)/(v[^/]+))(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+)(?:/(\w+))?)?/?",
            path,
        )
        if m is None:
            raise _unknown()
        group, version, ns, res, name, sub = m.groups()
        res = _PLURALS.get((group or "", res), res)
        if res in _RESOURCES and _RESOURCES[res][0] != (f"{group}/{version}" if group else "v1"):
            raise _unknown()
        if res == "ksvc" and not self.knative:
            raise _unknown()
        if res == "namespaces" and not group and not ns:
            if method != "GET" or sub:
                raise _not_allowed()
            if name is None:
                return _json(
                    200,
                    {
                        "kind": "NamespaceList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": self._last_rv()},
                        "items": [self._namespace(n) for n in self.namespaces],
                    },
                )
            if name not in self.namespaces:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{name}" not found',
                    {"name": name, "kind": "namespaces"},
                )
            return _json(200, {"kind": "Namespace", "apiVersion": "v1", **self._namespace(name)})
        if res not in _RESOURCES or _group(res) != (group or ""):
            raise _unknown()
        if query.get("watch") in ("true", "1"):
            if name is not None or method != "GET":
                raise _not_allowed()
            return self.watches.serve(res, ns, query)
        if name is None:
            if method == "GET":
                return _json(200, self._list(res, ns, query))
            if ns is None:
                raise _not_allowed()
            if method == "POST":
                return _json(201, self._create(res, ns, self._body(content)))
            if method == "DELETE":
                return _json(200, self._delete_collection(res, ns, query, content))
            raise _not_allowed()
        if ns is None:
            raise _unknown()
        if sub == "log" and res == "pods" and method == "GET":
            return self._log(ns, name, query)
        if sub and (sub != "status" or method != "GET"):
            raise _unknown()
        if method == "GET":
            return _json(200, self._get(res, ns, name))
        if method == "PUT":
            return _json(200, self._update(res, ns, name, self._body(content)))
        if method == "PATCH":
            return self._patch(res, ns, name, content, ctype, query)
        if method == "DELETE":
            opts = self._body(content) if content else {}
            opts = {
                **opts,
                **{k: query[k] for k in ("propagationPolicy", "gracePeriodSeconds") if k in query},
            }
            return _json(200, self._delete(res, ns, name, opts))
        raise _not_allowed()

    def _cluster_object(self, method: str, plural: str, name: str) -> httpx.Response:
        """The two cluster-scoped objects backends ask about: Knative's CRD and the custom
        metrics APIService (present as the switches say)."""
        if method != "GET":
            raise _not_allowed()
        if plural == "customresourcedefinitions" and name == KNATIVE_CRD and self.knative:
            return _json(
                200,
                {
                    "apiVersion": "apiextensions.k8s.io/v1",
                    "kind": "CustomResourceDefinition",
                    "metadata": {"name": name},
                    "spec": {
                        "group": "serving.knative.dev",
                        "names": {
                            "kind": "Service",
                            "plural": "services",
                            "shortNames": ["kservice", "ksvc"],
                        },
                        "scope": "Namespaced",
                    },
                },
            )
        if plural == "apiservices" and name == METRICS_APISERVICE and self.custom_metrics:
            return _json(
                200,
                {
                    "apiVersion": "apiregistration.k8s.io/v1",
                    "kind": "APIService",
                    "metadata": {"name": name},
                    "spec": {"group": "custom.metrics.k8s.io", "version": "v1beta1"},
                    "status": {
                        "conditions": [
                            {
                                "type": "Available",
                                "status": "True",
                                "reason": "Passed",
                                "message": "all checks passed",
                            }
                        ]
                    },
                },
            )
        group = (
            "apiextensions.k8s.io"
            if plural == "customresourcedefinitions"
            else "apiregistration.k8s.io"
        )
        raise ApiError(
            404,
            "NotFound",
            f'{plural}.{group} "{name}" not found',
            {"name": name, "group": group, "kind": plural},
        )

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _last_rv(self) -> str:
        return str(self._rv)

    def _iso(self, t: float | None = None) -> str:
        wall = self._wall0 + ((self.clock() if t is None else t) - self._t0)
        return datetime.fromtimestamp(wall, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _namespace(self, name: str) -> Obj:
        return {
            "metadata": {
                "name": name,
                "uid": self._ns_uids[name],
                "resourceVersion": "1",
                "creationTimestamp": self._iso(self._t0),
                "labels": {"kubernetes.io/metadata.name": name},
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }

    def _event(
        self,
        ns: str,
        kind: str,
        name: str,
        uid: str,
        type_: str,
        reason: str,
        message: str,
        component: str,
    ) -> Obj:
        involved = {
            "kind": kind,
            "namespace": ns,
            "name": name,
            "uid": uid,
            "apiVersion": "apps/v1" if kind == "StatefulSet" else "v1",
        }
        now = self._iso()
        for (r, n, _), event in self._store.items():
            if (
                r == "events"
                and n == ns
                and event.get("involvedObject") == involved
                and event.get("reason") == reason
                and event.get("message") == message
            ):
                event["count"] = event.get("count", 1) + 1
                event["lastTimestamp"] = now
                event["metadata"]["resourceVersion"] = self._next_rv()
                return event
        node = self._pods[uid].node[0] if uid in self._pods else None
        source = {
            "component": component,
            **({"host": node} if component == "kubelet" and node else {}),
        }
        return self._create(
            "events",
            ns,
            {
                "metadata": {"name": f"{name}.{next(self._seq):016x}"},
                "involvedObject": involved,
                "reason": reason,
                "message": message,
                "type": type_,
                "source": source,
                "count": 1,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "eventTime": None,
                "reportingComponent": component,
                "reportingInstance": node or "",
            },
        )
