"""The fake API server's (``kube_fake``) resources, its Status errors, and the pure helpers its
verbs share: selectors, merge patches, hashes, a pod's QoS class and health."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

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


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    body: Any  # parsed JSON, or None
    headers: dict[str, str]
    content: bytes = b""


@dataclass
class _Failure:
    method: str
    path: re.Pattern[str]
    body: Obj
    times: int = 1
