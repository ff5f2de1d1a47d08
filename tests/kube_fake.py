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

What it does not do: ``limit``/``continue`` paging, other resources or subresources
(``/status`` is GET only), ClusterRoles, admission beyond the checks above, JSON patch (RFC 6902),
field managers (apply is a strategic merge that may create), the full strategic-merge-patch
rules (lists merge by ``name``/``mountPath``/``containerPort``/``port`` only), ControllerRevisions,
finalizers (Foreground/Orphan deletion completes at once; a claim deleted while a pod mounts
it stays Terminating until no pod does, as pvc-protection has it), init containers, pod spec
immutability, a pod restarting after its image is patched. Nothing runs in the background:
every request (and ``objects``/``get``) first brings pods and controllers up to the clock.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import httpx
import kube_fake_logs
import kube_fake_watch
import kube_rbac

Obj = dict[str, Any]
ProxyHandler = Callable[[httpx.Request], httpx.Response]

_RESOURCES: dict[str, tuple[str, str]] = {  # plural -> (apiVersion, kind)
    "pods": ("v1", "Pod"),
    "services": ("v1", "Service"),
    "secrets": ("v1", "Secret"),
    "persistentvolumeclaims": ("v1", "PersistentVolumeClaim"),
    "events": ("v1", "Event"),
    "statefulsets": ("apps/v1", "StatefulSet"),
    "networkpolicies": ("networking.k8s.io/v1", "NetworkPolicy"),
    "serviceaccounts": ("v1", "ServiceAccount"),
    "roles": ("rbac.authorization.k8s.io/v1", "Role"),
    "rolebindings": ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    "deployments": ("apps/v1", "Deployment"),
    "horizontalpodautoscalers": ("autoscaling/v2", "HorizontalPodAutoscaler"),
    "ksvc": ("serving.knative.dev/v1", "Service"),  # Knative's; served only with knative=True
}
_PLURALS = {
    ("serving.knative.dev", "services"): "ksvc"
}  # (group, URL plural) -> key, where they differ
_RETURNS_OBJECT = {"pods", "services", "persistentvolumeclaims"}  # DELETE answers the object
_HAS_STATUS = {
    "pods",
    "services",
    "persistentvolumeclaims",
    "statefulsets",
    "deployments",
    "horizontalpodautoscalers",
    "ksvc",
}
KNATIVE_CRD = "services.serving.knative.dev"
METRICS_APISERVICE = "v1beta1.custom.metrics.k8s.io"
_NODES = (
    ("kind-worker", "172.18.0.2"),
    ("kind-worker2", "172.18.0.3"),
    ("kind-worker3", "172.18.0.4"),
)
_UNSCHEDULABLE = (
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes "
    "are available: 3 No preemption victims found for incoming pod."
)
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_STS_MUTABLE = (
    "replicas",
    "template",
    "updateStrategy",
    "persistentVolumeClaimRetentionPolicy",
    "minReadySeconds",
    "ordinals",
    "revisionHistoryLimit",
)
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
}


# ---------------------------------------------------------------------------- errors, helpers
def status_body(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    """A ``Status`` failure body as the API server sends it."""
    body: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None):
        super().__init__(message)
        self.body = status_body(code, reason, message, details)

    def response(self) -> httpx.Response:
        return httpx.Response(self.body["code"], json=self.body)


def _group(res: str) -> str:
    """The API group of a resource ("" for the core group's)."""
    version = _RESOURCES[res][0]
    return version.rpartition("/")[0]


def _plural(res: str) -> str:
    return next((p for (_, p), r in _PLURALS.items() if r == res), res)


def _qualified(res: str) -> str:
    return _plural(res) + (f".{_group(res)}" if _group(res) else "")


def _details(res: str, name: str, kind: str | None = None) -> Obj:
    return {"name": name, **({"group": _group(res)} if _group(res) else {}), "kind": kind or res}


def _not_found(res: str, name: str) -> ApiError:
    qualified = _qualified(res)
    return ApiError(404, "NotFound", f'{qualified} "{name}" not found', _details(res, name))


def _conflict(res: str, name: str, why: str) -> ApiError:
    qualified = _qualified(res)
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified} "{name}": {why}',
        _details(res, name),
    )


MAX_SECRET_BYTES = 1 << 20  # 1 MiB


def _invalid(
    res: str, name: str, path: str, detail: str, cause: str = "FieldValueInvalid"
) -> ApiError:
    kind = _RESOURCES[res][1] + (f".{_group(res)}" if _group(res) else "")
    details = _details(res, name, _RESOURCES[res][1])
    details["causes"] = [{"reason": cause, "message": detail, "field": path}]
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {path}: {detail}', details)


def _unknown() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def _bad(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _not_allowed() -> ApiError:
    return ApiError(
        405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
    )


def _json(code: int, obj: Obj) -> httpx.Response:
    return httpx.Response(code, json=obj)


def _hash(data: Any, n: int = 10) -> str:
    """Stable short hash in the API machinery's "safe" alphabet (no vowels, no 0/1/3)."""
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).digest()
    return "".join("bcdfghjklmnpqrstvwxz2456789"[b % 27] for b in digest[:n])


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _labels(obj: Obj) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def label_selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    for term in re.split(r",(?![^(]*\))", selector or ""):
        if not term.strip():
            continue
        if m := re.fullmatch(r"\s*([^\s!=,()]+)\s+(in|notin)\s+\(([^)]*)\)\s*", term):
            values = {v.strip() for v in m[3].split(",")}
            ok = (labels.get(m[1]) in values) == (m[2] == "in")
        elif m := re.fullmatch(r"\s*(!?)([^\s!=,()]+)\s*(?:(==|=|!=)\s*([^\s!=,()]*))?\s*", term):
            neg, key, op, value = m.groups()
            if op is None:
                ok = (key in labels) != bool(neg)
            elif neg:
                raise _bad(f"unable to parse requirement: {term!r}")
            else:
                ok = (labels.get(key) == value) == (op != "!=")
        else:
            raise _bad(f"unable to parse requirement: {term!r}")
        if not ok:
            return False
    return True


def field_selector_matches(selector: str | None, obj: Obj) -> bool:
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", term)
        if m is None:
            raise _bad(f"invalid field selector: {term!r}")
        value: Any = obj
        for part in m[1].split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if (("" if value is None else str(value)) == m[3]) == (m[2] == "!="):
            return False
    return True


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 JSON merge patch; ``strategic`` also merges the usual keyed lists by key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        old = out.get(key)
        if value is None:
            out.pop(key, None)
        elif (
            strategic
            and isinstance(value, list)
            and isinstance(old, list)
            and (mkey := _merge_key(key, old + value))
        ):
            merged = [copy.deepcopy(item) for item in old]
            for item in value:
                at = next((i for i, o in enumerate(merged) if o[mkey] == item[mkey]), None)
                if item.get("$patch") == "delete":
                    merged = [o for o in merged if o[mkey] != item[mkey]]
                elif at is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[at] = merge_patch(merged[at], item, True)
            out[key] = merged
        else:
            out[key] = merge_patch(old, value, strategic)
    return out


def _merge_key(name: str, items: list[Any]) -> str | None:
    keys = ["containerPort", "port"] if name == "ports" else [_MERGE_KEYS.get(name)]
    return next((k for k in keys if k and all(isinstance(i, dict) and k in i for i in items)), None)


def _normalize_image(image: str) -> str:
    head, _, rest = image.partition("/")
    if not rest or ("." not in head and ":" not in head and head != "localhost"):
        image = "docker.io/" + (image if rest else "library/" + image)
    last = image.rsplit("/", 1)[-1]
    return image if ":" in last or "@" in last else image + ":latest"


def _qos(spec: Obj) -> str:
    res = [c.get("resources") or {} for c in spec.get("containers", [])]
    if not any(r.get("requests") or r.get("limits") for r in res):
        return "BestEffort"

    def guaranteed(r: Obj) -> bool:
        lim = r.get("limits") or {}
        req = {**lim, **(r.get("requests") or {})}
        return all(lim.get(k) and req.get(k) == lim[k] for k in ("cpu", "memory"))

    return "Guaranteed" if all(guaranteed(r) for r in res) else "Burstable"


def _healthy(pod: Obj) -> bool:
    status = pod.get("status", {})
    return (
        status.get("phase") == "Running"
        and not pod["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
        )
    )


# ---------------------------------------------------------------------------- pod scripts
@dataclass(frozen=True)
class PodCtx:
    """What a status builder knows about the pod it describes (timestamps are RFC 3339)."""

    pod: Obj
    ip: str
    node: str
    host_ip: str
    created: str
    since: str  # when the current script step began

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]

    @property
    def uid(self) -> str:
        return self.pod["metadata"]["uid"]

    @property
    def containers(self) -> list[tuple[str, str]]:
        return [(c["name"], c.get("image", "")) for c in self.pod["spec"]["containers"]]

    def container_id(self, container: str, attempt: int = 0) -> str:
        return "containerd://" + _sha(f"{self.uid}/{container}/{attempt}")


def _no_events(ctx: PodCtx) -> list[tuple[str, str, str]]:
    return []


@dataclass(frozen=True)
class PodState:
    """One step of a pod's life: its status, the events and log text it brings."""

    status: Callable[[PodCtx], Obj]
    events: Callable[[PodCtx], list[tuple[str, str, str]]] = _no_events  # (type, reason, msg)
    logs: str | None = None  # current container's log text, set when the step begins
    previous_logs: str | None = None  # previous (crashed) container's log text
    ip: str | None = None  # pod IP to report instead of an allocated one
    # the runtime has removed the previous container (garbage-collected, log rotated away):
    # the kubelet answers a request for its log with HTTP 200 and a line of its own
    previous_log_lost: bool = False


PodScript = PodState | Sequence[tuple[float, PodState]] | None
PodBehavior = Callable[[Obj], PodScript]


def _cond(kind: str, ok: bool, at: str, reason: str | None = None, msg: str | None = None) -> Obj:
    out: Obj = {
        "type": kind,
        "status": "True" if ok else "False",
        "lastProbeTime": None,
        "lastTransitionTime": at,
    }
    return {**out, **({"reason": reason} if reason else {}), **({"message": msg} if msg else {})}


def _conditions(
    ctx: PodCtx, *, sandbox: bool, ready: bool, reason: str = "ContainersNotReady"
) -> list[Obj]:
    names = " ".join(n for n, _ in ctx.containers)
    msg = (
        None
        if ready or reason != "ContainersNotReady"
        else f"containers with unready status: [{names}]"
    )
    return [
        _cond("PodReadyToStartContainers", sandbox, ctx.since),
        _cond("Initialized", True, ctx.created),
        _cond("Ready", ready, ctx.since, None if ready else reason, msg),
        _cond("ContainersReady", ready, ctx.since, None if ready else reason, msg),
        _cond("PodScheduled", True, ctx.created),
    ]


def _pod_status(
    ctx: PodCtx, phase: str, conditions: list[Obj], containers: list[Obj], ip: bool = True
) -> Obj:
    status: Obj = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": ctx.host_ip,
        "hostIPs": [{"ip": ctx.host_ip}],
        "startTime": ctx.created,
        "containerStatuses": containers,
        "qosClass": _qos(ctx.pod["spec"]),
    }
    return {**status, **({"podIP": ctx.ip, "podIPs": [{"ip": ctx.ip}]} if ip else {})}


def _containers(
    ctx: PodCtx,
    state: Callable[[str, str], Obj],
    *,
    pulled: bool = True,
    ready: bool = False,
    restarts: int = 0,
    last: Callable[[str], Obj] | None = None,
) -> list[Obj]:
    out = []
    for name, image in ctx.containers:
        st = state(name, image)
        norm = _normalize_image(image)
        item: Obj = {
            "name": name,
            "image": norm if pulled else image,
            "imageID": f"{norm.rsplit(':', 1)[0]}@sha256:{_sha(norm)}" if pulled else "",
            "ready": ready,
            "restartCount": restarts,
            "started": "running" in st,
            "state": st,
            "lastState": last(name) if last else {},
        }
        if pulled and ("running" in st or "terminated" in st):
            item["containerID"] = st.get("terminated", {}).get("containerID") or ctx.container_id(
                name, restarts
            )
        elif "terminated" in item["lastState"]:
            item["containerID"] = item["lastState"]["terminated"]["containerID"]
        out.append(item)
    return out


def _terminated(ctx: PodCtx, name: str, code: int, reason: str, attempt: int) -> Obj:
    return {
        "exitCode": code,
        "reason": reason,
        "startedAt": ctx.created,
        "finishedAt": ctx.since,
        "containerID": ctx.container_id(name, attempt),
    }


def _started_events(ctx: PodCtx) -> list[tuple[str, str, str]]:
    return [
        e
        for n, img in ctx.containers
        for e in (
            ("Normal", "Pulled", f'Container image "{img}" already present on machine'),
            ("Normal", "Created", f"Created container {n}"),
            ("Normal", "Started", f"Started container {n}"),
        )
    ]


def pending() -> PodState:
    """Accepted but not yet scheduled (what every pod starts as)."""
    return PodState(lambda ctx: {"phase": "Pending", "qosClass": _qos(ctx.pod["spec"])})


def unschedulable(message: str = _UNSCHEDULABLE) -> PodState:
    def status(ctx: PodCtx) -> Obj:
        return {
            "phase": "Pending",
            "qosClass": _qos(ctx.pod["spec"]),
            "conditions": [_cond("PodScheduled", False, ctx.since, "Unschedulable", message)],
        }

    return PodState(status, lambda ctx: [("Warning", "FailedScheduling", message)])


def container_creating() -> PodState:
    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Pending",
            _conditions(ctx, sandbox=False, ready=False),
            _containers(
                ctx, lambda n, i: {"waiting": {"reason": "ContainerCreating"}}, pulled=False
            ),
            ip=False,
        )
    )


def ready(ip: str | None = None) -> PodState:
    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Running",
            _conditions(ctx, sandbox=True, ready=True),
            _containers(ctx, lambda n, i: {"running": {"startedAt": ctx.since}}, ready=True),
        ),
        _started_events,
        ip=ip,
    )


def running_not_ready(ip: str | None = None) -> PodState:
    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Running",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(ctx, lambda n, i: {"running": {"startedAt": ctx.since}}),
        ),
        _started_events,
        ip=ip,
    )


def _pull_error(image: str) -> str:
    ref = _normalize_image(image)
    return (
        f'rpc error: code = NotFound desc = failed to pull and unpack image "{ref}": '
        f'failed to resolve reference "{ref}": {ref}: not found'
    )


def _pull_failure(reason: str, image: str | None, message: str | None) -> PodState:
    backoff = reason == "ImagePullBackOff"

    def text(img: str) -> str:
        return message or (
            f'Back-off pulling image "{image or img}"' if backoff else _pull_error(image or img)
        )

    def events(ctx: PodCtx) -> list[tuple[str, str, str]]:
        out = []
        for _, img in ctx.containers:
            img = image or img
            err = message if message and not backoff else _pull_error(img)
            out += [
                ("Normal", "Pulling", f'Pulling image "{img}"'),
                ("Warning", "Failed", f'Failed to pull image "{img}": {err}'),
                ("Warning", "Failed", "Error: ErrImagePull"),
            ]
            if backoff:
                out += [
                    ("Normal", "BackOff", f'Back-off pulling image "{img}"'),
                    ("Warning", "Failed", "Error: ImagePullBackOff"),
                ]
        return out

    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Pending",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(
                ctx, lambda n, i: {"waiting": {"reason": reason, "message": text(i)}}, pulled=False
            ),
        ),
        events,
    )


def image_pull_backoff(image: str | None = None, message: str | None = None) -> PodState:
    """``image`` defaults to each container's own; ``message`` replaces the waiting message."""
    return _pull_failure("ImagePullBackOff", image, message)


def err_image_pull(image: str | None = None, message: str | None = None) -> PodState:
    return _pull_failure("ErrImagePull", image, message)


def _backoff(restarts: int) -> str:
    seconds = min(10 * 2 ** (restarts - 1), 300)
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


def crash_loop(
    exit_code: int = 1, logs: str | None = None, restarts: int = 1, reason: str = "Error"
) -> PodState:
    """Restarted ``restarts`` times, now in back-off; ``logs`` is the crashed container's log."""
    restarts = max(1, restarts)

    def status(ctx: PodCtx) -> Obj:
        def waiting(name: str, image: str) -> Obj:
            return {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {_backoff(restarts)} restarting failed container={name} "
                    f"pod={ctx.name}_{ctx.namespace}({ctx.uid})",
                }
            }

        return _pod_status(
            ctx,
            "Running",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(
                ctx,
                waiting,
                restarts=restarts,
                last=lambda n: {"terminated": _terminated(ctx, n, exit_code, reason, restarts - 1)},
            ),
        )

    def events(ctx: PodCtx) -> list[tuple[str, str, str]]:
        return _started_events(ctx) + [
            (
                "Warning",
                "BackOff",
                f"Back-off restarting failed container {n} in pod "
                f"{ctx.name}_{ctx.namespace}({ctx.uid})",
            )
            for n, _ in ctx.containers
        ]

    return PodState(status, events, previous_logs=logs)


def terminated_error(
    exit_code: int = 1, logs: str | None = None, reason: str | None = None
) -> PodState:
    """First termination, before any restart; with restartPolicy Never/OnFailure the phase is
    Failed/Succeeded as the kubelet reports it, else Running."""
    why = reason or ("Completed" if exit_code == 0 else "Error")

    def status(ctx: PodCtx) -> Obj:
        policy = ctx.pod["spec"].get("restartPolicy", "Always")
        phase = (
            "Succeeded"
            if exit_code == 0 and policy != "Always"
            else "Failed"
            if exit_code != 0 and policy == "Never"
            else "Running"
        )
        why_not = {"Succeeded": "PodCompleted", "Failed": "PodFailed"}.get(
            phase, "ContainersNotReady"
        )
        return _pod_status(
            ctx,
            phase,
            _conditions(ctx, sandbox=True, ready=False, reason=why_not),
            _containers(ctx, lambda n, i: {"terminated": _terminated(ctx, n, exit_code, why, 0)}),
        )

    return PodState(status, _started_events, logs=logs)


def terminated_again(
    exit_code: int = 1,
    logs: str | None = None,
    restarts: int = 1,
    previous_logs: str | None = None,
    previous_log_lost: bool = False,
) -> PodState:
    """Exited again after ``restarts`` restart(s), before the kubelet reports the back-off:
    ``state`` is this run's end (its log ``logs``), ``lastState`` the run before (its log
    ``previous_logs``, or the kubelet's answer for a lost one: see ``PodState``)."""
    restarts = max(1, restarts)
    why = "Completed" if exit_code == 0 else "Error"

    def status(ctx: PodCtx) -> Obj:
        return _pod_status(
            ctx,
            "Running",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(
                ctx,
                lambda n, i: {"terminated": _terminated(ctx, n, exit_code, why, restarts)},
                restarts=restarts,
                last=lambda n: {"terminated": _terminated(ctx, n, exit_code, why, restarts - 1)},
            ),
        )

    return PodState(
        status,
        _started_events,
        logs=logs,
        previous_logs=previous_logs,
        previous_log_lost=previous_log_lost,
    )


def oom_killed(logs: str | None = None, restarts: int = 0) -> PodState:
    """Exit 137 OOMKilled: the first kill (``restarts=0``) or in back-off after ``restarts``."""
    return (
        crash_loop(137, logs, restarts, "OOMKilled")
        if restarts
        else terminated_error(137, logs, "OOMKilled")
    )


def create_container_config_error(message: str = 'secret "x" not found') -> PodState:
    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Pending",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(
                ctx,
                lambda n, i: {
                    "waiting": {"reason": "CreateContainerConfigError", "message": message}
                },
                pulled=False,
            ),
        ),
        lambda ctx: [
            e
            for _, img in ctx.containers
            for e in (
                ("Normal", "Pulled", f'Container image "{img}" already present on machine'),
                ("Warning", "Failed", f"Error: {message}"),
            )
        ],
    )


def _steps(script: PodScript) -> list[tuple[float, PodState]]:
    if script is None:
        return [(0.0, ready())]
    if isinstance(script, PodState):
        return [(0.0, script)]
    return sorted(((float(t), s) for t, s in script), key=lambda step: step[0])


# ---------------------------------------------------------------------------- the server
class FakeClock:
    """A clock for ``FakeKube(clock=...)`` that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    body: Any  # parsed JSON, or None
    headers: dict[str, str]
    content: bytes = b""


@dataclass
class _PodMeta:
    steps: list[tuple[float, PodState]]
    start: float  # clock time the steps are measured from
    created: float
    ip: str
    node: tuple[str, str]
    step: int = -1
    delete_at: float | None = None


@dataclass
class _Failure:
    method: str
    path: re.Pattern[str]
    body: Obj
    times: int = 1


class FakeKube(httpx.BaseTransport):
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

    # ----------------------------------------------------------------- test conveniences
    def objects(self, kind: str, ns: str | None = None) -> list[Obj]:
        """Stored objects of ``kind`` ("pods", "Pod", "statefulset"...), all namespaces if None."""
        res = self._resource(kind)
        with self.lock:
            self._tick()
            return [
                copy.deepcopy(o)
                for (r, n, _), o in sorted(self._store.items())
                if r == res and ns in (None, n)
            ]

    def get(self, kind: str, ns: str, name: str) -> Obj | None:
        with self.lock:
            self._tick()
            return copy.deepcopy(self._store.get((self._resource(kind), ns, name)))

    def create(self, kind: str, ns: str, body: Obj) -> Obj:
        """Seed an object as if POSTed (raises ``ApiError`` where the server would refuse)."""
        with self.lock:
            obj = copy.deepcopy(self._create(self._resource(kind), ns, body))
            self._tick()
            return obj

    def service_account_token(self, ns: str, name: str) -> str | None:
        """A token for ServiceAccount ``name`` (None if there is none), as the kubelet
        projects into a pod: the API server authorizes it by the account's Roles."""
        with self.lock:
            account = self._store.get(("serviceaccounts", ns, name))
            if account is None:
                return None
            return self.accounts.issue(ns, name, account["metadata"]["uid"])

    def set_pod_script(self, pod_name: str, script: PodScript, ns: str | None = None) -> None:
        """Script this pod name from now on, the live pod (timed from now) and any re-creation
        (timed from its creation); ``None`` goes back to ``pod_behavior``."""
        ns = ns or self.namespaces[0]
        with self.lock:
            if script is None:
                self._overrides.pop((ns, pod_name), None)
            else:
                self._overrides[(ns, pod_name)] = script
            pod = self._store.get(("pods", ns, pod_name))
            if pod is not None:
                meta = self._pods[pod["metadata"]["uid"]]
                meta.steps, meta.start, meta.step = self._script_for(pod), self.clock(), -1
                self._tick()

    def set_logs(
        self,
        pod_name: str,
        text: str,
        previous: bool = False,
        *,
        container: str | None = None,
        ns: str | None = None,
    ) -> None:
        """Log text of the pod's current (or previous) container; cleared when the pod goes."""
        with self.lock:
            self._logs[(ns or self.namespaces[0], pod_name, container, previous)] = text

    def append_logs(
        self, pod_name: str, text: str, *, container: str | None = None, ns: str | None = None
    ) -> None:
        with self.lock:
            key = (ns or self.namespaces[0], pod_name, container, False)
            self._logs[key] = self._logs.get(key, "") + text

    def add_event(
        self,
        involved_pod_name: str,
        reason: str,
        message: str,
        type: str = "Warning",
        *,
        ns: str | None = None,
        kind: str = "Pod",
        component: str = "kubelet",
    ) -> Obj:
        with self.lock:
            ns = ns or self.namespaces[0]
            res = self._resource(kind)
            obj = self._store.get((res, ns, involved_pod_name))
            return copy.deepcopy(
                self._event(
                    ns,
                    kind,
                    involved_pod_name,
                    obj["metadata"]["uid"] if obj else "",
                    type,
                    reason,
                    message,
                    component,
                )
            )

    def fail_next(
        self,
        method: str,
        path_regex: str,
        status: int = 500,
        reason: str = "InternalError",
        message: str | None = None,
        times: int = 1,
    ) -> None:
        """Answer the next ``times`` requests matching (method or "*", re.search on the path)
        with this Status error, before any other processing."""
        with self.lock:
            self._failures.append(
                _Failure(
                    method.upper(),
                    re.compile(path_regex),
                    status_body(status, reason, message or f"injected {reason} ({status})"),
                    times,
                )
            )

    def find_requests(
        self, method: str | None = None, path_regex: str = ""
    ) -> list[RecordedRequest]:
        with self.lock:
            return [
                r
                for r in self.requests
                if method in (None, r.method) and re.search(path_regex, r.path)
            ]

    # ----------------------------------------------------------------- transport
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

    def set_status(self, kind: str, ns: str, name: str, status: Obj) -> None:
        """Set an object's status as its controller would (an HPA's, for tests that play it)."""
        with self.lock:
            obj = self._get(self._resource(kind), ns, name)
            obj["status"] = {
                "observedGeneration": obj["metadata"].get("generation", 1),
                **copy.deepcopy(status),
            }
            obj["metadata"]["resourceVersion"] = self._next_rv()

    # ----------------------------------------------------------------- storage verbs
    @staticmethod
    def _resource(kind: str) -> str:
        k = kind.lower()
        if k in ("ksvc", "knativeservice", "knativeservices"):
            return "ksvc"
        if k == "hpa":
            return "horizontalpodautoscalers"
        for res in (k, k + "s"):
            if res in _RESOURCES:
                return res
        raise KeyError(f"unknown kind {kind!r}; one of {sorted(_RESOURCES)}")

    @staticmethod
    def _body(content: bytes) -> Obj:
        try:
            body = json.loads(content)
        except ValueError as err:
            raise _bad(f"the request body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

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

    def _get(self, res: str, ns: str, name: str) -> Obj:
        obj = self._store.get((res, ns, name))
        if obj is None:
            raise _not_found(res, name)
        return obj

    def _select(self, res: str, ns: str | None, query: dict[str, str]) -> list[Obj]:
        return [
            o
            for (r, n, _), o in sorted(self._store.items())
            if r == res
            and ns in (None, n)
            and label_selector_matches(query.get("labelSelector"), _labels(o))
            and field_selector_matches(query.get("fieldSelector"), o)
        ]

    def _list(
        self, res: str, ns: str | None, query: dict[str, str], objs: list[Obj] | None = None
    ) -> Obj:
        items = [
            {k: v for k, v in o.items() if k not in ("kind", "apiVersion")}
            for o in (self._select(res, ns, query) if objs is None else objs)
        ]
        api_version, kind = _RESOURCES[res]
        return {
            "kind": kind + "List",
            "apiVersion": api_version,
            "metadata": {"resourceVersion": self._last_rv()},
            "items": items,
        }

    def _check_body(self, res: str, ns: str, obj: Obj) -> None:
        api_version, kind = _RESOURCES[res]
        if obj.get("kind", kind) != kind or obj.get("apiVersion", api_version) != api_version:
            raise _bad(
                f"the body is a {obj.get('apiVersion')}/{obj.get('kind')}, "
                f"this endpoint takes {api_version}/{kind}"
            )
        if obj.get("metadata", {}).get("namespace", ns) != ns:
            raise _bad(
                "the namespace of the provided object does not match the namespace sent "
                "on the request"
            )

    def _create(self, res: str, ns: str, body: Obj) -> Obj:
        if ns not in self.namespaces:
            raise ApiError(
                404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"}
            )
        self._check_body(res, ns, body)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + _hash(str(uuid.uuid4()), 5)
        name = meta.get("name") or ""
        if not name:
            raise _invalid(
                res,
                name,
                "metadata.name",
                "Required value: name or generateName is required",
                "FieldValueRequired",
            )
        if (res, ns, name) in self._store:
            qualified = _qualified(res)
            raise ApiError(
                409, "AlreadyExists", f'{qualified} "{name}" already exists', _details(res, name)
            )
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(k, None)
        obj["apiVersion"], obj["kind"] = _RESOURCES[res]
        meta.update(
            namespace=ns,
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_rv(),
            creationTimestamp=self._iso(),
        )
        self._prepare(res, obj, None)
        if res in ("pods", "statefulsets", "deployments", "ksvc", "horizontalpodautoscalers"):
            meta["generation"] = 1
        self._store[(res, ns, name)] = obj
        if res == "pods":
            now = self.clock()
            n = next(self._counter)
            self._pods[meta["uid"]] = _PodMeta(
                self._script_for(obj), now, now, f"10.244.{n // 250}.{n % 250 + 2}", _NODES[n % 3]
            )
        if res == "statefulsets":
            self._current_rev[meta["uid"]] = self._revision(obj)
        return obj

    def _script_for(self, pod: Obj) -> list[tuple[float, PodState]]:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if key in self._overrides:
            return _steps(self._overrides[key])
        return _steps(self.pod_behavior(copy.deepcopy(pod)) if self.pod_behavior else None)

    def _update(self, res: str, ns: str, name: str, body: Obj) -> Obj:
        old = self._get(res, ns, name)
        self._check_body(res, ns, body)
        meta = body.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise _bad(
                f"the name of the object ({meta['name']}) does not match the name on the "
                f"URL ({name})"
            )
        if meta.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"]):
            raise _conflict(
                res,
                name,
                "the object has been modified; please apply your changes "
                "to the latest version and try again",
            )
        if meta.get("uid") not in (None, "", old["metadata"]["uid"]):
            raise _conflict(
                res,
                name,
                f"Precondition failed: UID in precondition: {meta['uid']}, "
                f"UID in object meta: {old['metadata']['uid']}",
            )
        new = copy.deepcopy(body)
        new["apiVersion"], new["kind"] = _RESOURCES[res]
        for k in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if k in old["metadata"]:
                new["metadata"][k] = old["metadata"][k]
            else:
                new["metadata"].pop(k, None)
        if res in _HAS_STATUS:
            new["status"] = copy.deepcopy(old.get("status", {}))
        self._prepare(res, new, old)
        if new == old:
            return old  # a no-op write keeps its resourceVersion
        if "generation" in old["metadata"] and new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        self._store[(res, ns, name)] = new
        return new

    def _patch(
        self, res: str, ns: str, name: str, content: bytes, ctype: str, query: dict[str, str]
    ) -> httpx.Response:
        kind = ctype.split(";")[0].strip()
        if kind not in (
            "application/merge-patch+json",
            "application/strategic-merge-patch+json",
            "application/apply-patch+yaml",
        ):
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an "
                f"unknown format - accepted media types include: "
                f"application/merge-patch+json, application/strategic-merge-patch+json, "
                f"application/apply-patch+yaml (fake API server; got {kind!r})",
            )
        patch = self._body(content)
        if kind == "application/apply-patch+yaml":  # JSON is YAML; the fake takes JSON only
            if not query.get("fieldManager"):
                raise _invalid(
                    res,
                    name,
                    "fieldManager",
                    "Required value: is required for apply patch",
                    "FieldValueRequired",
                )
            if patch.get("metadata", {}).get("name") != name:
                raise _bad(f"the name of the object does not match the name on the URL ({name})")
            if (res, ns, name) not in self._store:
                return _json(201, self._create(res, ns, patch))
        old = self._get(res, ns, name)
        merged = merge_patch(old, patch, strategic=kind != "application/merge-patch+json")
        return _json(200, self._update(res, ns, name, merged))

    def _delete(self, res: str, ns: str, name: str, opts: Obj) -> Obj:
        obj = self._get(res, ns, name)
        pre = opts.get("preconditions") or {}
        for k in ("uid", "resourceVersion"):
            if pre.get(k) and pre[k] != obj["metadata"][k]:
                raise _conflict(
                    res,
                    name,
                    f"Precondition failed: {k} in precondition: {pre[k]}, "
                    f"{k} in object meta: {obj['metadata'][k]}",
                )
        grace = opts.get("gracePeriodSeconds")
        if res == "pods":
            return copy.deepcopy(self._delete_pod(obj, None if grace is None else int(grace)))
        if res == "persistentvolumeclaims" and self._claim_in_use(ns, name):
            # the pvc-protection finalizer: Terminating until no pod mounts it (_release_claims)
            if "deletionTimestamp" not in obj["metadata"]:
                obj["metadata"]["deletionTimestamp"] = self._iso()
                obj["metadata"]["deletionGracePeriodSeconds"] = 0
                obj["metadata"]["resourceVersion"] = self._next_rv()
            return copy.deepcopy(obj)
        del self._store[(res, ns, name)]
        policy = opts.get("propagationPolicy") or "Background"
        self._collect_dependents(ns, obj["metadata"]["uid"], orphan=policy == "Orphan")
        if res in _RETURNS_OBJECT or policy in ("Orphan", "Foreground"):
            out = copy.deepcopy(obj)
            out["metadata"]["deletionTimestamp"] = self._iso()
            if policy in ("Orphan", "Foreground"):
                out["metadata"]["finalizers"] = [
                    "orphan" if policy == "Orphan" else "foregroundDeletion"
                ]
            return out
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {**_details(res, name), "uid": obj["metadata"]["uid"]},
        }

    def _collect_dependents(self, ns: str, owner_uid: str, orphan: bool) -> None:
        for (res, n, name), obj in list(self._store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if n != ns or not any(r.get("uid") == owner_uid for r in refs):
                continue
            kept = [r for r in refs if r.get("uid") != owner_uid]
            if orphan or kept:
                obj["metadata"]["ownerReferences"] = kept
                if not kept:
                    del obj["metadata"]["ownerReferences"]
                obj["metadata"]["resourceVersion"] = self._next_rv()
            elif (res, n, name) in self._store:
                self._delete(res, ns, name, {})

    def _delete_collection(self, res: str, ns: str, query: dict[str, str], content: bytes) -> Obj:
        opts = self._body(content) if content else {}
        deleted = []
        for obj in self._select(res, ns, query):
            out = self._delete(res, ns, obj["metadata"]["name"], opts)
            deleted.append(obj if out.get("kind") == "Status" else out)
        return self._list(res, ns, query, deleted)

    def _delete_pod(self, pod: Obj, grace: int | None) -> Obj:
        meta = pod["metadata"]
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        linger = min(float(grace), self.pod_termination_seconds)
        if not pod["spec"].get("nodeName"):
            linger = 0.0  # never reached a kubelet: gone at once
        now = self.clock()
        pod_meta = self._pods[meta["uid"]]
        if "deletionTimestamp" not in meta or linger <= 0:
            meta["deletionTimestamp"] = self._iso(now + grace)
            meta["deletionGracePeriodSeconds"] = grace
            meta["resourceVersion"] = self._next_rv()
            pod_meta.delete_at = now + linger
        if pod_meta.delete_at is not None and pod_meta.delete_at <= now:
            self._remove_pod(pod)
        return pod

    def _remove_pod(self, pod: Obj) -> None:
        meta = pod["metadata"]
        self._store.pop(("pods", meta["namespace"], meta["name"]), None)
        self._pods.pop(meta["uid"], None)
        for key in [k for k in self._logs if k[:2] == (meta["namespace"], meta["name"])]:
            del self._logs[key]
        self._collect_dependents(meta["namespace"], meta["uid"], orphan=False)

    # ----------------------------------------------------------------- defaults, validation
    def _prepare(self, res: str, obj: Obj, old: Obj | None) -> None:
        meta, name = obj["metadata"], obj["metadata"]["name"]
        pattern, what = (
            (_DNS1035, "a DNS-1035 label")
            if res in ("services", "ksvc")
            else (_DNS1123, "a lowercase RFC 1123 subdomain")
        )
        too_long = len(name) > (63 if res in ("services", "ksvc") else 253)
        if old is None and (too_long or not pattern.fullmatch(name)):
            raise _invalid(
                res,
                name,
                "metadata.name",
                f'Invalid value: "{name}": {what} must '
                f"consist of lower case alphanumeric characters, '-' or '.' "
                f"(regex used for validation is '{pattern.pattern}')",
            )
        for key, value in (meta.get("labels") or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
                raise _invalid(
                    res,
                    name,
                    "metadata.labels",
                    f'Invalid value: "{value}": a valid '
                    f"label value must be 63 characters or less, alphanumeric, '-', '_' "
                    f"or '.', starting and ending with an alphanumeric (key {key!r})",
                )
        spec = obj.get("spec")
        if res == "pods":
            self._pod_spec(res, name, spec, "spec")
            if old is None:
                obj["status"] = {"phase": "Pending", "qosClass": _qos(spec)}
            elif old["spec"].get("nodeName"):
                spec.setdefault("nodeName", old["spec"]["nodeName"])
        elif res == "statefulsets":
            self._sts_spec(name, spec, old)
            if old is None:
                obj["status"] = {"replicas": 0, "availableReplicas": 0}
        elif res == "deployments":
            self._deployment_spec(name, spec, old)
            if old is None:
                obj["status"] = {}
        elif res == "horizontalpodautoscalers":
            self._hpa_spec(name, spec)
            if old is None:
                obj["status"] = {"currentReplicas": 0, "desiredReplicas": 0}
        elif res == "ksvc":
            self._ksvc_spec(name, spec)
            if old is None:
                obj["status"] = {}
        elif res == "secrets":
            obj.setdefault("type", "Opaque")
            for k, v in (obj.pop("stringData", None) or {}).items():
                obj.setdefault("data", {})[k] = base64.b64encode(v.encode()).decode()
            # the API server's limit on a Secret's data, decoded (MaxSecretSize)
            size = sum(len(base64.b64decode(v)) for v in (obj.get("data") or {}).values())
            if size > MAX_SECRET_BYTES:
                raise _invalid(
                    "secrets",
                    name,
                    "data",
                    f"Too long: may not be more than {MAX_SECRET_BYTES} bytes",
                )
        elif res == "services":
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            old_ip = (old or {}).get("spec", {}).get("clusterIP")
            n = next(self._seq) if old_ip is None and "clusterIP" not in spec else 0
            spec.setdefault("clusterIP", old_ip or f"10.96.{n // 250}.{n % 250 + 2}")
            spec.setdefault("clusterIPs", [spec["clusterIP"]])
            for k, v in (
                ("sessionAffinity", "None"),
                ("ipFamilies", ["IPv4"]),
                ("ipFamilyPolicy", "SingleStack"),
                ("internalTrafficPolicy", "Cluster"),
            ):
                spec.setdefault(k, v)
            for port in spec.get("ports", []):
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
            obj.setdefault("status", {"loadBalancer": {}})
        elif res == "persistentvolumeclaims":
            spec = obj.setdefault("spec", {})
            spec.setdefault("storageClassName", "standard")
            spec.setdefault("volumeMode", "Filesystem")
            spec.setdefault("volumeName", "pvc-" + meta["uid"])
            size = spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")
            bound = {
                "phase": "Bound",
                "accessModes": spec.get("accessModes", ["ReadWriteOnce"]),
                "capacity": {"storage": size},
            }
            if old is not None:
                obj["status"] = old.get("status") or bound
            elif self.pvc_bind_seconds > 0 or "does-not-exist" in spec["storageClassName"]:
                obj["status"] = {"phase": "Pending"}
                self._pvc_bind_at[(meta["namespace"], meta["name"])] = (
                    self.clock() + self.pvc_bind_seconds
                )
            else:
                obj["status"] = bound

    def _pod_spec(self, res: str, name: str, spec: Any, path: str) -> None:
        if not isinstance(spec, dict) or not spec.get("containers"):
            raise _invalid(res, name, f"{path}.containers", "Required value", "FieldValueRequired")
        for i, c in enumerate(spec["containers"]):
            for k in ("name", "image"):
                if not c.get(k):
                    raise _invalid(
                        res,
                        name,
                        f"{path}.containers[{i}].{k}",
                        "Required value",
                        "FieldValueRequired",
                    )
            c.setdefault(
                "imagePullPolicy",
                "Always" if _normalize_image(c["image"]).endswith(":latest") else "IfNotPresent",
            )
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            c.setdefault("resources", {})
            for port in c.get("ports", []):
                port.setdefault("protocol", "TCP")
        for k, v in (
            ("restartPolicy", "Always"),
            ("terminationGracePeriodSeconds", 30),
            ("dnsPolicy", "ClusterFirst"),
            ("schedulerName", "default-scheduler"),
            ("serviceAccountName", "default"),
            ("securityContext", {}),
            ("enableServiceLinks", True),
            ("priority", 0),
        ):
            spec.setdefault(k, v)
        spec.setdefault("serviceAccount", spec["serviceAccountName"])

    def _sts_spec(self, name: str, spec: Any, old: Obj | None) -> None:
        res = "statefulsets"
        if not isinstance(spec, dict) or not (spec.get("selector") or {}).get("matchLabels"):
            raise _invalid(res, name, "spec.selector", "Required value", "FieldValueRequired")
        template = spec.get("template") or {}
        tlabels = template.get("metadata", {}).get("labels") or {}
        if any(tlabels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()):
            raise _invalid(
                res,
                name,
                "spec.template.metadata.labels",
                f"Invalid value: {tlabels!r}: `selector` does not match template `labels`",
            )
        self._pod_spec(res, name, template.get("spec"), "spec.template.spec")
        if template["spec"]["restartPolicy"] != "Always":
            raise _invalid(
                res,
                name,
                "spec.template.spec.restartPolicy",
                f"Unsupported value: "
                f'"{template["spec"]["restartPolicy"]}": supported values: "Always"',
                "FieldValueNotSupported",
            )
        for k, v in (
            ("replicas", 1),
            ("podManagementPolicy", "OrderedReady"),
            ("revisionHistoryLimit", 10),
            ("updateStrategy", {"type": "RollingUpdate"}),
            (
                "persistentVolumeClaimRetentionPolicy",
                {"whenDeleted": "Retain", "whenScaled": "Retain"},
            ),
        ):
            spec.setdefault(k, v)
        if spec["updateStrategy"].get("type", "RollingUpdate") == "RollingUpdate":
            spec["updateStrategy"].setdefault("type", "RollingUpdate")
            spec["updateStrategy"].setdefault("rollingUpdate", {"partition": 0})
        if old is not None and any(
            spec.get(k) != old["spec"].get(k)
            for k in set(spec) | set(old["spec"])
            if k not in _STS_MUTABLE
        ):
            raise _invalid(
                res,
                name,
                "spec",
                "Forbidden: updates to statefulset spec for fields "
                "other than 'replicas', 'ordinals', 'template', 'updateStrategy', "
                "'revisionHistoryLimit', 'persistentVolumeClaimRetentionPolicy' and "
                "'minReadySeconds' are forbidden",
                "FieldValueForbidden",
            )

    def _selector_matches_template(self, res: str, name: str, spec: Obj) -> None:
        if not isinstance(spec, dict) or not (spec.get("selector") or {}).get("matchLabels"):
            raise _invalid(res, name, "spec.selector", "Required value", "FieldValueRequired")
        tlabels = (spec.get("template") or {}).get("metadata", {}).get("labels") or {}
        if any(tlabels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()):
            raise _invalid(
                res,
                name,
                "spec.template.metadata.labels",
                f"Invalid value: {tlabels!r}: `selector` does not match template `labels`",
            )

    def _deployment_spec(self, name: str, spec: Any, old: Obj | None) -> None:
        res = "deployments"
        self._selector_matches_template(res, name, spec)
        self._pod_spec(res, name, spec["template"].get("spec"), "spec.template.spec")
        if spec["template"]["spec"]["restartPolicy"] != "Always":
            raise _invalid(
                res,
                name,
                "spec.template.spec.restartPolicy",
                'Unsupported value: supported values: "Always"',
                "FieldValueNotSupported",
            )
        for k, v in (
            ("replicas", 1),
            ("revisionHistoryLimit", 10),
            ("progressDeadlineSeconds", 600),
            (
                "strategy",
                {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"},
                },
            ),
        ):
            spec.setdefault(k, v)
        if old is not None and spec["selector"] != old["spec"]["selector"]:
            raise _invalid(
                res,
                name,
                "spec.selector",
                f"Invalid value: {spec['selector']!r}: field is immutable",
                "FieldValueInvalid",
            )

    def _hpa_spec(self, name: str, spec: Any) -> None:
        res = "horizontalpodautoscalers"
        ref = (spec or {}).get("scaleTargetRef") or {}
        if not ref.get("kind") or not ref.get("name"):
            raise _invalid(res, name, "spec.scaleTargetRef", "Required value", "FieldValueRequired")
        low, high = spec.setdefault("minReplicas", 1), spec.get("maxReplicas")
        if not isinstance(high, int) or high < 1:
            raise _invalid(
                res, name, "spec.maxReplicas", f"Invalid value: {high}: must be greater than 0"
            )
        if low < 1 or low > high:
            raise _invalid(
                res,
                name,
                "spec.minReplicas",
                f"Invalid value: {low}: must be between 1 and "
                "maxReplicas (0 needs the HPAScaleToZero feature gate)",
            )

    def _ksvc_spec(self, name: str, spec: Any) -> None:
        """Knative's webhook, in part: one container, at most one port, named for its protocol."""
        res = "ksvc"
        template = (spec or {}).get("template") or {}
        for c in (template.get("spec") or {}).get("containers") or []:
            if isinstance(c, dict):
                c.setdefault("name", "user-container")  # Knative names an unnamed container so
        self._pod_spec(res, name, template.get("spec"), "spec.template.spec")
        containers = template["spec"]["containers"]
        if len(containers) != 1:
            raise _invalid(
                res,
                name,
                "spec.template.spec.containers",
                f"expected exactly one, got {len(containers)}",
            )
        ports = containers[0].get("ports") or []
        if len(ports) > 1 or any(p.get("name") not in (None, "http1", "h2c") for p in ports):
            raise _invalid(
                res,
                name,
                "spec.template.spec.containers[0].ports",
                "more than one container port is set, or its name is not one of http1, h2c",
            )

    # ----------------------------------------------------------------- controllers
    def _claim_in_use(self, ns: str, name: str) -> bool:
        """A pod that still exists (Terminating too) mounts claim ``name``."""
        return any(
            r == "pods"
            and n == ns
            and any(
                (v.get("persistentVolumeClaim") or {}).get("claimName") == name
                for v in o["spec"].get("volumes") or []
            )
            for (r, n, _), o in self._store.items()
        )

    def _release_claims(self) -> None:
        """The pvc-protection controller: a claim deleted while in use goes once no pod mounts it."""
        for (r, ns, name), obj in list(self._store.items()):
            if (
                r == "persistentvolumeclaims"
                and obj["metadata"].get("deletionTimestamp")
                and not self._claim_in_use(ns, name)
            ):
                del self._store[(r, ns, name)]

    def _tick(self) -> None:
        """Bring pods, kubelet and controllers up to the clock, until nothing changes."""
        self.watches.run_due()
        self._bind_claims()
        for _ in range(500):
            changed = False
            for sts in [o for (r, _, _), o in self._store.items() if r == "statefulsets"]:
                changed |= self._reconcile(sts)
            for dep in [o for (r, _, _), o in self._store.items() if r == "deployments"]:
                changed |= self._reconcile_replicas(
                    dep,
                    dep["spec"]["template"],
                    int(dep["spec"].get("replicas", 1)),
                    f"{dep['metadata']['name']}-{_hash(dep['spec']['template'])}",
                )
            for ksvc in [o for (r, _, _), o in self._store.items() if r == "ksvc"]:
                changed |= self._reconcile_ksvc(ksvc)
            changed |= self._refresh_pods()
            if not changed:
                break
        for sts in [o for (r, _, _), o in self._store.items() if r == "statefulsets"]:
            self._sts_status(sts)
        for dep in [o for (r, _, _), o in self._store.items() if r in ("deployments", "ksvc")]:
            self._replicas_status(dep)
        for hpa in [o for (r, _, _), o in self._store.items() if r == "horizontalpodautoscalers"]:
            self._hpa_status(hpa)
        self._release_claims()
        self.watches.record()

    def _hpa_status(self, hpa: Obj) -> None:
        """The HPA controller of a cluster without metrics-server (or a custom metrics adapter):
        it reads the target's scale, finds no metric and says so; it never scales. Once per spec
        (``observedGeneration``): a status set by ``set_status`` stays."""
        md, spec = hpa["metadata"], hpa["spec"]
        status = hpa.get("status") or {}
        if status.get("observedGeneration") == md.get("generation", 1):
            return
        ref = spec["scaleTargetRef"]
        target = (
            self._store.get(("deployments", md["namespace"], ref["name"]))
            if ref["kind"] == "Deployment"
            else None
        )
        at = self._iso()
        if target is None:
            conditions = [
                {
                    "type": "AbleToScale",
                    "status": "False",
                    "lastTransitionTime": at,
                    "reason": "FailedGetScale",
                    "message": f"the HPA controller was unable to get the "
                    f'target\'s current scale: deployments/scale.apps "{ref["name"]}" not found',
                }
            ]
            replicas = 0
        else:
            replicas = int(target["spec"].get("replicas", 1))
            metric = (spec.get("metrics") or [{}])[0]
            if metric.get("type") == "Pods":
                name = metric["pods"]["metric"]["name"]
                reason, why = (
                    "FailedGetPodsMetric",
                    (
                        f"unable to get metric {name}: unable to fetch metrics from "
                        "custom metrics API: the server could not find the "
                        "metric " + name + " for pods"
                    ),
                )
            else:
                resource = (metric.get("resource") or {}).get("name", "cpu")
                reason, why = (
                    "FailedGetResourceMetric",
                    (
                        f"failed to get {resource} utilization: unable to get metrics for resource {resource}: "
                        "unable to fetch metrics from resource metrics API: the server could not find the requested "
                        "resource (get pods.metrics.k8s.io)"
                    ),
                )
            conditions = [
                {
                    "type": "AbleToScale",
                    "status": "True",
                    "lastTransitionTime": at,
                    "reason": "SucceededGetScale",
                    "message": "the HPA controller was able to get the target's current scale",
                },
                {
                    "type": "ScalingActive",
                    "status": "False",
                    "lastTransitionTime": at,
                    "reason": reason,
                    "message": f"the HPA was unable to compute the replica count: {why}",
                },
            ]
        hpa["status"] = {
            "observedGeneration": md.get("generation", 1),
            "currentReplicas": replicas,
            "desiredReplicas": 0,
            "conditions": conditions,
        }
        md["resourceVersion"] = self._next_rv()

    def _owned(self, owner: Obj) -> list[Obj]:
        md = owner["metadata"]
        return [
            o
            for (r, n, _), o in self._store.items()
            if r == "pods"
            and n == md["namespace"]
            and any(ref["uid"] == md["uid"] for ref in o["metadata"].get("ownerReferences", []))
        ]

    def _reconcile_replicas(
        self,
        owner: Obj,
        template: Obj,
        want: int,
        prefix: str,
        extra_labels: dict[str, str] | None = None,
    ) -> bool:
        """A Deployment's (and its ReplicaSets', folded in) sync: ``want`` pods of ``template``
        named ``PREFIX-xxxxx``, the newest (not-ready first) removed on scale-down; pods of an older
        template go once as many of the current one are ready (maxUnavailable 0), or at once
        when none are wanted."""
        digest = _hash(template)
        pods = [p for p in self._owned(owner) if not p["metadata"].get("deletionTimestamp")]
        current = [p for p in pods if _labels(p).get("pod-template-hash") == digest]
        old = [p for p in pods if _labels(p).get("pod-template-hash") != digest]
        changed = False
        for _ in range(want - len(current)):
            self._create_replica(owner, template, digest, prefix, extra_labels or {})
            changed = True
        if len(current) > want:
            order = sorted(
                current, key=lambda p: (_healthy(p), -self._pods[p["metadata"]["uid"]].created)
            )
            for pod in order[: len(current) - want]:
                self._owner_delete(owner, pod)
                changed = True
        if old and (want == 0 or sum(_healthy(p) for p in current) >= want):
            for pod in old:
                self._owner_delete(owner, pod)
                changed = True
        return changed

    def _create_replica(
        self, owner: Obj, template: Obj, digest: str, prefix: str, extra: dict[str, str]
    ) -> Obj:
        md = owner["metadata"]
        template = copy.deepcopy(template)
        tmeta = template.get("metadata") or {}
        pod_meta: Obj = {
            "generateName": f"{prefix}-",
            "labels": {**(tmeta.get("labels") or {}), **extra, "pod-template-hash": digest},
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": md["name"],
                    "uid": md["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }
        if tmeta.get("annotations"):
            pod_meta["annotations"] = dict(tmeta["annotations"])
        spec = template["spec"]
        spec.pop("containerConcurrency", None)  # Knative's, not a pod's
        pod = self._create("pods", md["namespace"], {"metadata": pod_meta, "spec": spec})
        self._event(
            md["namespace"],
            owner["kind"],
            md["name"],
            md["uid"],
            "Normal",
            "SuccessfulCreate",
            f"Created pod: {pod['metadata']['name']}",
            "replicaset-controller",
        )
        return pod

    def _owner_delete(self, owner: Obj, pod: Obj) -> None:
        md = owner["metadata"]
        self._delete_pod(pod, None)
        self._event(
            md["namespace"],
            owner["kind"],
            md["name"],
            md["uid"],
            "Normal",
            "SuccessfulDelete",
            f"Deleted pod: {pod['metadata']['name']}",
            "replicaset-controller",
        )

    def _reconcile_ksvc(self, ksvc: Obj) -> bool:
        """Knative, in short: each template is a revision NAME-0000N whose pods
        (NAME-0000N-deployment-...) number its initial scale (``autoscaling.knative.dev/
        initial-scale``, default 1), or what ``knative_scale[(ns, name)]`` says its autoscaler wants."""
        md = ksvc["metadata"]
        template = ksvc["spec"]["template"]
        revisions = self._revisions.setdefault(md["uid"], {})
        digest = _hash(template)
        number = revisions.setdefault(digest, len(revisions) + 1)
        revision = f"{md['name']}-{number:05d}"
        notes = (template.get("metadata") or {}).get("annotations") or {}
        want = self.knative_scale.get(
            (md["namespace"], md["name"]),
            int(notes.get("autoscaling.knative.dev/initial-scale", 1)),
        )
        labels = {
            "serving.knative.dev/service": md["name"],
            "serving.knative.dev/revision": revision,
            "serving.knative.dev/configuration": md["name"],
        }
        changed = self._reconcile_replicas(
            ksvc, template, want, f"{revision}-deployment-{digest[:9]}", labels
        )
        healthy = [
            p
            for p in self._owned(ksvc)
            if _healthy(p) and _labels(p).get("pod-template-hash") == digest
        ]
        ready = bool(healthy) or want == 0
        at = self._iso()
        status = {
            "observedGeneration": md.get("generation", 1),
            "latestCreatedRevisionName": revision,
            "url": f"http://{md['name']}.{md['namespace']}.example.com",
            "conditions": [
                {
                    "type": t,
                    "status": "True" if ready else "Unknown",
                    "lastTransitionTime": at,
                    **(
                        {}
                        if ready
                        else {
                            "reason": "RevisionMissing",
                            "message": f'Configuration "{md["name"]}" is waiting '
                            "for a Revision to become ready.",
                        }
                    ),
                }
                for t in ("ConfigurationsReady", "Ready", "RoutesReady")
            ],
        }
        if ready:
            status["latestReadyRevisionName"] = revision
        old = {k: v for k, v in (ksvc.get("status") or {}).items()}
        if {
            **old,
            "conditions": [
                {k: v for k, v in c.items() if k != "lastTransitionTime"}
                for c in old.get("conditions", [])
            ],
        } != {
            **status,
            "conditions": [
                {k: v for k, v in c.items() if k != "lastTransitionTime"}
                for c in status["conditions"]
            ],
        }:
            ksvc["status"] = status
            md["resourceVersion"] = self._next_rv()
        return changed

    def _replicas_status(self, owner: Obj) -> None:
        if owner["kind"] != "Deployment":
            return
        md = owner["metadata"]
        digest = _hash(owner["spec"]["template"])
        pods = [p for p in self._owned(owner) if not p["metadata"].get("deletionTimestamp")]
        ready_count = sum(_healthy(p) for p in pods)
        status = {
            "observedGeneration": md.get("generation", 1),
            "replicas": len(pods),
            "updatedReplicas": sum(_labels(p).get("pod-template-hash") == digest for p in pods),
            "readyReplicas": ready_count,
            "availableReplicas": ready_count,
            "unavailableReplicas": max(0, len(pods) - ready_count),
        }
        status = {k: v for k, v in status.items() if v or k in ("observedGeneration", "replicas")}
        if status != owner.get("status"):
            owner["status"] = status
            md["resourceVersion"] = self._next_rv()

    def _bind_claims(self) -> None:
        """The volume binder: claims whose time has come get a volume (or fail to)."""
        now = self.clock()
        for (ns, name), at in list(self._pvc_bind_at.items()):
            claim = self._store.get(("persistentvolumeclaims", ns, name))
            if claim is None:
                del self._pvc_bind_at[(ns, name)]
                continue
            spec, uid = claim["spec"], claim["metadata"]["uid"]
            if "does-not-exist" in spec["storageClassName"]:
                self._event(
                    ns,
                    "PersistentVolumeClaim",
                    name,
                    uid,
                    "Warning",
                    "ProvisioningFailed",
                    f'storageclass.storage.k8s.io "{spec["storageClassName"]}" not found',
                    "persistentvolume-controller",
                )
                del self._pvc_bind_at[(ns, name)]
                continue
            if now < at:
                continue
            del self._pvc_bind_at[(ns, name)]
            claim["status"] = {
                "phase": "Bound",
                "accessModes": spec.get("accessModes", ["ReadWriteOnce"]),
                "capacity": {
                    "storage": spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")
                },
            }
            claim["metadata"]["resourceVersion"] = self._next_rv()
            self._event(
                ns,
                "PersistentVolumeClaim",
                name,
                uid,
                "Normal",
                "ProvisioningSucceeded",
                f"Successfully provisioned volume {spec['volumeName']}",
                "persistentvolume-controller",
            )

    def _unbound_claims(self, pod: Obj) -> str | None:
        """The scheduler's message for a pod whose claims are missing or not bound yet."""
        ns = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes") or []:
            name = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if not name:
                continue
            claim = self._store.get(("persistentvolumeclaims", ns, name))
            if claim is None:
                return (
                    f'0/{len(_NODES)} nodes are available: persistentvolumeclaim "{name}" not '
                    f"found. preemption: 0/{len(_NODES)} nodes are available: {len(_NODES)} "
                    "Preemption is not helpful for scheduling."
                )
            if (claim.get("status") or {}).get("phase") != "Bound":
                return (
                    f"0/{len(_NODES)} nodes are available: pod has unbound immediate "
                    f"PersistentVolumeClaims. preemption: 0/{len(_NODES)} nodes are available: "
                    f"{len(_NODES)} Preemption is not helpful for scheduling."
                )
        return None

    def _refresh_pods(self) -> bool:
        now, changed = self.clock(), False
        for pod in [o for (r, _, _), o in self._store.items() if r == "pods"]:
            md, meta = pod["metadata"], self._pods.get(pod["metadata"]["uid"])
            if meta is None:
                continue  # garbage-collected earlier in this loop
            if meta.delete_at is not None and now >= meta.delete_at:
                self._remove_pod(pod)
                changed = True
                continue
            blocked = None if pod["spec"].get("nodeName") else self._unbound_claims(pod)
            if blocked is not None:  # not schedulable yet: its script starts once it is
                meta.start = now
                index, state, since = -2, unschedulable(blocked), meta.created
            else:
                index = max(
                    (i for i, (t, _) in enumerate(meta.steps) if meta.start + t <= now), default=-1
                )
                state = meta.steps[index][1] if index >= 0 else pending()
                since = meta.start + (meta.steps[index][0] if index >= 0 else 0.0)
            ctx = PodCtx(
                pod,
                state.ip or meta.ip,
                meta.node[0],
                meta.node[1],
                self._iso(meta.created),
                self._iso(since),
            )
            status = state.status(ctx)
            scheduled = any(
                c["type"] == "PodScheduled" and c["status"] == "True"
                for c in status.get("conditions", [])
            )
            if scheduled and not pod["spec"].get("nodeName"):
                pod["spec"]["nodeName"] = meta.node[0]
                self._event(
                    md["namespace"],
                    "Pod",
                    md["name"],
                    md["uid"],
                    "Normal",
                    "Scheduled",
                    f"Successfully assigned {md['namespace']}/{md['name']} to {meta.node[0]}",
                    "default-scheduler",
                )
            if index != meta.step:
                meta.step = index
                for type_, reason, message in state.events(ctx):
                    component = "default-scheduler" if "Scheduling" in reason else "kubelet"
                    self._event(
                        md["namespace"],
                        "Pod",
                        md["name"],
                        md["uid"],
                        type_,
                        reason,
                        message,
                        component,
                    )
                for text, previous in ((state.logs, False), (state.previous_logs, True)):
                    if text is not None:
                        self._logs[(md["namespace"], md["name"], None, previous)] = text
                for cs in status.get("containerStatuses", []) if state.previous_log_lost else []:
                    gone = (cs.get("lastState") or {}).get("terminated", {}).get("containerID", "")
                    self._logs[(md["namespace"], md["name"], cs["name"], True)] = (
                        f"unable to retrieve container logs for {gone}"
                    )
            if status != pod.get("status"):
                pod["status"] = status
                md["resourceVersion"] = self._next_rv()
                changed = True
        return changed

    @staticmethod
    def _revision(sts: Obj) -> str:
        return f"{sts['metadata']['name']}-{_hash(sts['spec']['template'])}"

    def _reconcile(self, sts: Obj) -> bool:
        """The StatefulSet controller's sync, as in pkg/controller/statefulset (simplified)."""
        md, spec = sts["metadata"], sts["spec"]
        ns, name, want = md["namespace"], md["name"], int(spec.get("replicas", 1))
        start = int(
            (spec.get("ordinals") or {}).get("start", 0)
        )  # spec.ordinals.start (GA in 1.31)
        ordered = spec.get("podManagementPolicy") != "Parallel"
        revision, changed = self._revision(sts), False
        pods: dict[int, Obj] = {}
        for (r, n, pod_name), pod in list(self._store.items()):
            m = re.fullmatch(re.escape(name) + r"-(\d+)", pod_name)
            if r != "pods" or n != ns or m is None:
                continue
            refs = pod["metadata"].get("ownerReferences") or []
            owner = next((ref for ref in refs if ref.get("controller")), None)
            if owner is None and label_selector_matches(
                ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items()),
                _labels(pod),
            ):
                pod["metadata"]["ownerReferences"] = refs + [self._owner_ref(sts)]  # adopt
                pod["metadata"]["resourceVersion"] = self._next_rv()
                owner = self._owner_ref(sts)
            if owner is None or owner.get("uid") != md["uid"]:
                return changed  # someone else's pod holds the name: stuck, as for real
            pods[int(m[1])] = pod
        for i in range(start, start + want):
            if i not in pods:
                pods[i] = self._create_sts_pod(sts, i, revision)
                changed = True
                if ordered:
                    return changed
            elif ordered and not _healthy(pods[i]):
                return changed
        for i in sorted((i for i in pods if not start <= i < start + want), reverse=True):
            if not pods[i]["metadata"].get("deletionTimestamp"):
                self._controller_delete(sts, pods[i])
                changed = True
            if ordered:
                return changed
        strategy = spec.get("updateStrategy", {})
        if strategy.get("type", "RollingUpdate") != "RollingUpdate":
            return changed
        partition = int((strategy.get("rollingUpdate") or {}).get("partition", 0))
        for i in range(start + want - 1, start + partition - 1, -1):
            pod = pods.get(i)
            if pod is None:
                return changed
            if _labels(pod).get("controller-revision-hash") != revision and not pod["metadata"].get(
                "deletionTimestamp"
            ):
                self._controller_delete(sts, pod)
                return True
            if not _healthy(pod):
                return changed
        return changed

    def _owner_ref(self, sts: Obj) -> Obj:
        return {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": sts["metadata"]["name"],
            "uid": sts["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def _controller_delete(self, sts: Obj, pod: Obj) -> None:
        pod_name, md = pod["metadata"]["name"], sts["metadata"]
        self._delete_pod(pod, None)
        self._event(
            md["namespace"],
            "StatefulSet",
            md["name"],
            md["uid"],
            "Normal",
            "SuccessfulDelete",
            f"delete Pod {pod_name} in StatefulSet {md['name']} successful",
            "statefulset-controller",
        )

    def _create_sts_pod(self, sts: Obj, ordinal: int, revision: str) -> Obj:
        md, spec = sts["metadata"], sts["spec"]
        ns, name = md["namespace"], f"{md['name']}-{ordinal}"
        template = copy.deepcopy(spec["template"])
        tmeta = template.get("metadata") or {}
        pod_spec = template["spec"]
        pod_spec["hostname"] = name
        if spec.get("serviceName"):
            pod_spec["subdomain"] = spec["serviceName"]
        for claim in spec.get("volumeClaimTemplates") or []:
            claim_name = f"{claim['metadata']['name']}-{name}"
            if ("persistentvolumeclaims", ns, claim_name) not in self._store:
                self._create(
                    "persistentvolumeclaims",
                    ns,
                    {
                        "metadata": {
                            "name": claim_name,
                            "labels": dict(spec["selector"]["matchLabels"]),
                        },
                        "spec": copy.deepcopy(claim.get("spec", {})),
                    },
                )
            volumes = pod_spec.setdefault("volumes", [])
            if all(v.get("name") != claim["metadata"]["name"] for v in volumes):
                volumes.append(
                    {
                        "name": claim["metadata"]["name"],
                        "persistentVolumeClaim": {"claimName": claim_name},
                    }
                )
        pod_meta: Obj = {
            "name": name,
            "labels": {
                **(tmeta.get("labels") or {}),
                "controller-revision-hash": revision,
                "statefulset.kubernetes.io/pod-name": name,
                "apps.kubernetes.io/pod-index": str(ordinal),
            },
            "ownerReferences": [self._owner_ref(sts)],
        }
        if tmeta.get("annotations"):
            pod_meta["annotations"] = dict(tmeta["annotations"])
        pod = self._create("pods", ns, {"metadata": pod_meta, "spec": pod_spec})
        self._event(
            ns,
            "StatefulSet",
            md["name"],
            md["uid"],
            "Normal",
            "SuccessfulCreate",
            f"create Pod {name} in StatefulSet {md['name']} successful",
            "statefulset-controller",
        )
        return pod

    def _sts_status(self, sts: Obj) -> None:
        md, spec = sts["metadata"], sts["spec"]
        update = self._revision(sts)
        pods = [
            o
            for (r, n, _), o in self._store.items()
            if r == "pods"
            and n == md["namespace"]
            and not o["metadata"].get("deletionTimestamp")
            and any(ref["uid"] == md["uid"] for ref in o["metadata"].get("ownerReferences", []))
        ]
        revs = [_labels(p).get("controller-revision-hash") for p in pods]
        ready_count = sum(_healthy(p) for p in pods)
        if revs.count(update) == len(pods) == ready_count == spec.get("replicas", 1):
            self._current_rev[md["uid"]] = update
        current = self._current_rev.get(md["uid"], update)
        status = {
            "replicas": len(pods),
            "readyReplicas": ready_count,
            "currentReplicas": revs.count(current),
            "updatedReplicas": revs.count(update),
            "availableReplicas": ready_count,
            "observedGeneration": md.get("generation", 1),
            "currentRevision": current,
            "updateRevision": update,
            "collisionCount": 0,
        }
        status = {
            k: v
            for k, v in status.items()
            if v or k in ("replicas", "availableReplicas", "collisionCount")
        }
        if status != sts.get("status"):
            sts["status"] = status
            md["resourceVersion"] = self._next_rv()

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

    def _activator(self, request: httpx.Request, ns: str, service: str) -> httpx.Response:
        """A request through a Knative revision's Service reaches Knative's activator: with the
        routing headers its ingress sets, the revision gets a replica (played here by
        ``knative_scale``); the fake answers at once. Anything else: no such Service."""
        revision = request.headers.get("knative-serving-revision")
        for ksvc in self.objects("ksvc") if self.knative else []:
            md = ksvc["metadata"]
            if (
                md["namespace"] == ns
                and revision == service
                and service.startswith(md["name"] + "-")
                and request.headers.get("knative-serving-namespace") == ns
            ):
                key = (ns, md["name"])
                self.knative_scale[key] = max(1, self.knative_scale.get(key, 0))
                self._tick()
                return _json(200, {"status": "ok"})
        return _json(404, status_body(404, "NotFound", f'services "{service}" not found'))

    # ----------------------------------------------------------------- logs, proxy
    def _log_text(self, ns: str, pod: str, container: str, previous: bool) -> str:
        text = self._logs.get((ns, pod, container, previous))
        return self._logs.get((ns, pod, None, previous), "") if text is None else text

    def _log(self, ns: str, name: str, query: dict[str, str]) -> httpx.Response:
        pod = self._get("pods", ns, name)
        names = [c["name"] for c in pod["spec"]["containers"]]
        container = query.get("container")
        if container is None and len(names) != 1:
            raise _bad(
                f"a container name must be specified for pod {name}, choose one of: "
                f"[{' '.join(names)}]"
            )
        container = container or names[0]
        if container not in names:
            raise _bad(f"container {container} is not valid for pod {name}")
        if not pod["spec"].get("nodeName"):
            return httpx.Response(200, text="", headers={"content-type": "text/plain"})
        statuses = pod["status"].get("containerStatuses") or []
        cs = next((s for s in statuses if s["name"] == container), {})
        state, last = cs.get("state", {}), cs.get("lastState", {})
        where = f'container "{container}" in pod "{name}"'
        if query.get("previous") in ("true", "1"):
            if "terminated" not in last:
                raise _bad(f"previous terminated {where} not found")
            previous = True
        elif "running" in state or "terminated" in state:
            previous = False
        elif "terminated" in last:
            previous = True  # in back-off: the kubelet serves the last run's log
        elif "waiting" in state:
            reason = state["waiting"].get("reason", "")
            raise _bad(
                f"{where} is waiting to start: "
                + {
                    "ErrImagePull": "image can't be pulled",
                    "ImagePullBackOff": "trying and failing to pull image",
                }.get(reason, reason)
            )
        else:
            raise _bad(f"{where} is waiting to start - no logs yet")
        full = self._log_text(ns, name, container, previous)
        text = full
        if "tailLines" in query:
            n = int(query["tailLines"])
            text = "".join(text.splitlines(keepends=True)[-n:]) if n > 0 else ""
        if "limitBytes" in query:
            text = text.encode()[: int(query["limitBytes"])].decode(errors="ignore")
        headers = {"content-type": "text/plain"}
        if query.get("follow") in ("true", "1") and "running" in state and not previous:
            key = kube_fake_logs.LogKey(ns, name, container, pod["metadata"]["uid"], len(full))
            return httpx.Response(
                200, headers=headers, stream=kube_fake_logs.FollowStream(self, key, text)
            )
        return httpx.Response(200, text=text, headers=headers)

    def _proxy(self, request: httpx.Request, ns: str, target: str, rest: str) -> httpx.Response:
        parts = target.split(":")
        if len(parts) > 3:
            raise _bad(f"invalid pod request {target!r}")
        scheme = parts[0] if len(parts) == 3 else "http"
        name, port = (parts[1:] if len(parts) == 3 else parts + [""])[:2]
        with self.lock:
            self._tick()
            pod = copy.deepcopy(self._get("pods", ns, name))
        if not port:
            port = next(
                (
                    str(c["ports"][0]["containerPort"])
                    for c in pod["spec"]["containers"]
                    if c.get("ports")
                ),
                "",
            )
        ip = pod["status"].get("podIP")
        if not ip:
            raise _bad("address not allowed")
        host = f"{ip}:{port or (443 if scheme == 'https' else 80)}"
        handler = self.proxy_handlers.get((name, int(port))) if port.isdigit() else None
        if handler is None:
            raise ApiError(
                503,
                "ServiceUnavailable",
                f"error trying to reach service: dial tcp {host}: connect: connection refused",
            )
        query = ("?" + request.url.query.decode()) if request.url.query else ""
        headers = [
            (k, v)
            for k, v in request.headers.multi_items()
            if k.lower() not in ("authorization", "host", "content-length", "transfer-encoding")
        ]
        forwarded = httpx.Request(
            request.method,
            f"{scheme}://{host}{rest}{query}",
            headers=headers,
            content=request.content,
        )
        try:
            answer = handler(forwarded)
        except httpx.ConnectTimeout:
            raise ApiError(
                503,
                "ServiceUnavailable",
                f"error trying to reach service: dial tcp {host}: i/o timeout",
            ) from None
        except httpx.ConnectError:
            raise ApiError(
                503,
                "ServiceUnavailable",
                f"error trying to reach service: dial tcp {host}: connect: connection refused",
            ) from None
        except httpx.TransportError as err:  # connected, then lost: Go says what the read saw
            raise ApiError(
                503, "ServiceUnavailable", f"error trying to reach service: read tcp {host}: {err}"
            ) from None
        # marked: a pod answered (a proxy can lose only such a response, never its own errors)
        return httpx.Response(
            answer.status_code,
            headers=answer.headers,
            stream=answer.stream,
            extensions={"ktlite_from_pod": True},
        )
