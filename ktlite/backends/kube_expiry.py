"""``inactivity_ttl`` on Kubernetes: the objects that let a deployment delete itself, and
how a client learns how idle a deployment is.

A StatefulSet restarts a server that exits, so on Kubernetes the TTL is a teardown. A
deployment NAME with ``Compute(inactivity_ttl=...)`` gets, besides its other objects:

- the annotation :data:`TTL_ANNOTATION` (seconds) on its StatefulSets, which a client reads;
- a ServiceAccount, Role and RoleBinding, all ``NAME-ttl``: the Role may ``get`` the
  deployment's StatefulSets and ``delete`` only its own objects, each by name
  (``resourceNames``): its StatefulSets, Service, Secrets, NetworkPolicy and the
  ServiceAccount itself. The Role and RoleBinding are owned by the ServiceAccount
  (``ownerReferences``), so deleting the ServiceAccount, last, removes them too;
- on its pods, that ServiceAccount and its token as a projected file with a short lifetime
  (:data:`TOKEN_EXPIRY_S`, renewed by the kubelet) at ``/var/run/ktlite/api``, with the
  cluster's CA; the pod-wide automount stays off, so the token is at that path only.

Pod 0's server deletes the objects once it has been idle that long
(``ktlite_server.inactivity``). Where pods cannot reach the API server, its ``/health``
still reports ``idle_s``: :func:`idleness` reads it through the API server's pod proxy, and
``ktlite list`` / ``ktlite teardown --expired`` tear down what has expired. A Compute that
names its own ``service_account`` keeps it: its pods cannot delete themselves, and the
clients' sweep is what removes them.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import TYPE_CHECKING, Any

import httpx

from ktlite.backends import kube_tls
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.backends.kube_labels import (
    NAME_LABEL,
    labels,
    token_secret_name,
    user_secret_name,
)
from ktlite.errors import DeployError
from ktlite_wire.headers import TOKEN_HEADER, bearer

if TYPE_CHECKING:
    from ktlite.specs.deployment_spec import DeploymentSpec
    from ktlite.specs.secrets import Resolved

logger = logging.getLogger(__name__)

TTL_ANNOTATION = "ktlite.dev/inactivity-ttl"  # seconds, on the deployment's StatefulSets
API_DIR = "/var/run/ktlite/api"  # the projected token and CA (ktlite_server.selfteardown)
API_VOLUME = "ktlite-api"
TOKEN_EXPIRY_S = 600  # the shortest lifetime the API server issues a projected token for
KINDS = ("ServiceAccount", "Role", "RoleBinding")
RBAC = "rbac.authorization.k8s.io"
_PATHS = {  # the API path of each kind the pods delete, under the namespace's prefix
    "StatefulSet": "/apis/apps/v1/namespaces/{namespace}/statefulsets",
    "Service": "/api/v1/namespaces/{namespace}/services",
    "Secret": "/api/v1/namespaces/{namespace}/secrets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
}


def access_name(name: str) -> str:
    """The ServiceAccount, Role and RoleBinding of deployment ``name``."""
    return f"{name}-ttl"


def ttl_seconds(spec: DeploymentSpec) -> float | None:
    """The TTL in seconds; None without one, and for an autoscaled deployment (it scales)."""
    return spec.pod.calls.inactivity_seconds if spec.autoscale is None else None


def deletes_itself(spec: DeploymentSpec) -> bool:
    """Whether the deployment's pods get the ServiceAccount that deletes it (a TTL, and no
    ServiceAccount of the user's, which the pods keep)."""
    return ttl_seconds(spec) is not None and not spec.pod.kubernetes.service_account


def doomed(
    spec: DeploymentSpec, parts: list[str], secrets: list[Resolved]
) -> list[tuple[str, str]]:
    """(kind, name) of what pod 0 deletes, in order: the StatefulSets first (no pod is
    restarted), the ServiceAccount last (its token authorizes the others)."""
    name = spec.name
    return [
        *(("StatefulSet", part) for part in parts),
        ("Service", name),
        ("Secret", token_secret_name(name)),
        *(("Secret", user_secret_name(name, r.key)) for r in secrets if not r.existing),
        ("NetworkPolicy", name),
        ("ServiceAccount", access_name(name)),
    ]


def give_pod(
    pod: dict[str, Any], spec: DeploymentSpec, parts: list[str], secrets: list[Resolved]
) -> None:
    """What a pod of a deployment with a TTL gets, in place: the TTL; where it deletes
    itself, the ServiceAccount, its token as a projected file, and what to delete."""
    ttl = ttl_seconds(spec)
    if ttl is None:
        return
    container = pod["containers"][0]
    env = container.setdefault("env", [])
    env.append({"name": "KTLITE_INACTIVITY_TTL", "value": f"{ttl:g}"})
    if not deletes_itself(spec):
        return
    paths = [f"{_PATHS[kind]}/{obj}" for kind, obj in doomed(spec, parts, secrets)]
    env.append({"name": "KTLITE_TEARDOWN_PATHS", "value": json.dumps(paths)})
    pod["serviceAccountName"] = access_name(spec.name)
    pod.setdefault("volumes", []).append(
        {
            "name": API_VOLUME,
            "projected": {
                "defaultMode": 0o400,
                "sources": [
                    {
                        "serviceAccountToken": {
                            "path": "token",
                            "expirationSeconds": TOKEN_EXPIRY_S,
                        }
                    },
                    {
                        "configMap": {
                            "name": "kube-root-ca.crt",
                            "items": [{"key": "ca.crt", "path": "ca.crt"}],
                        }
                    },
                ],
            },
        }
    )
    container.setdefault("volumeMounts", []).append(
        {"name": API_VOLUME, "mountPath": API_DIR, "readOnly": True}
    )


def access_objects(
    spec: DeploymentSpec, namespace: str, parts: list[str], secrets: list[Resolved]
) -> list[dict[str, Any]]:
    """The ServiceAccount, Role and RoleBinding of a deployment that deletes itself (none
    otherwise). The Role names each object it may delete."""
    if not deletes_itself(spec):
        return []
    name = access_name(spec.name)
    meta = {"name": name, "namespace": namespace, "labels": labels(spec.name)}
    names: dict[str, list[str]] = {}
    for kind, obj in doomed(spec, parts, secrets):
        names.setdefault(kind, []).append(obj)

    def rule(group: str, resource: str, verbs: list[str], kind: str) -> dict[str, Any]:
        return {
            "apiGroups": [group],
            "resources": [resource],
            "verbs": verbs,
            "resourceNames": names[kind],
        }

    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta,
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": f"{RBAC}/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                rule("apps", "statefulsets", ["get", "delete"], "StatefulSet"),
                rule("", "services", ["delete"], "Service"),
                rule("", "secrets", ["delete"], "Secret"),
                rule("networking.k8s.io", "networkpolicies", ["delete"], "NetworkPolicy"),
                rule("", "serviceaccounts", ["delete"], "ServiceAccount"),
            ],
        },
        {
            "apiVersion": f"{RBAC}/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def apply_access(
    api: KubeApi, objects: list[dict[str, Any]], name: str, created: list[tuple[str, str]]
) -> None:
    """Make the deployment's ServiceAccount, Role and RoleBinding as ``objects`` has them (the
    Role and RoleBinding owned by the ServiceAccount), update a Role whose rules changed, or
    delete them where the deployment no longer deletes itself. Before the StatefulSets."""
    wanted = [o for o in objects if o["kind"] in KINDS]
    if not wanted:  # one made by a deploy with a TTL goes
        try:
            stale = api.get("ServiceAccount", access_name(name)) is not None
        except KubeApiError as e:
            if e.status != 403:
                raise
            stale = False  # an account without the rights: no deploy of it made one
        if stale:
            drop_access(api, name)
        return
    try:
        account = api.get("ServiceAccount", access_name(name))
        if account is None:
            account = api.create(wanted[0])
            created.append(("ServiceAccount", access_name(name)))
        owner = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "uid": account["metadata"]["uid"],
        }
        for obj in wanted[1:]:
            obj = {**obj, "metadata": {**obj["metadata"], "ownerReferences": [owner]}}
            current = api.get(obj["kind"], obj["metadata"]["name"])
            if current is None:
                api.create(obj)
                created.append((obj["kind"], obj["metadata"]["name"]))
            elif any(current.get(k) != obj.get(k) for k in ("rules", "roleRef", "subjects")):
                api.replace(obj, current["metadata"]["resourceVersion"])
    except KubeApiError as e:
        if e.status != 403:
            raise
        raise DeployError(
            f"cannot manage the ServiceAccount, Role and RoleBinding {access_name(name)!r} in "
            f"namespace {api.namespace!r} ({e}); a deployment with an inactivity_ttl gets them "
            "so that its pods can delete it once idle: give your Role the verbs get, create, "
            "update, delete on serviceaccounts, and on roles and rolebindings of "
            "rbac.authorization.k8s.io (docs/kubernetes.md, 'Permissions')"
        ) from e


def drop_access(api: KubeApi, name: str) -> bool:
    """Delete the deployment's ServiceAccount, Role and RoleBinding; True if one was there.
    An account without the right to manage them has none: ktlite could not have made them."""
    found = False
    for kind in reversed(KINDS):
        try:
            found |= api.delete(kind, access_name(name))
        except KubeApiError as e:
            if e.status not in (403, 404):
                raise
    return found


def idleness(
    api: KubeApi, http: httpx.Client, sts: dict[str, Any], port: int
) -> dict[str, float | None]:
    """``idle_s`` and ``ttl_s`` of the deployment whose head StatefulSet is ``sts``: the TTL
    from its annotation, the idle time from pod 0's ``/health`` through the API server's pod
    proxy (None where the pod does not answer, or there is no TTL)."""
    raw = ((sts.get("metadata") or {}).get("annotations") or {}).get(TTL_ANNOTATION)
    try:
        ttl = float(raw) if raw else None
    except ValueError:
        ttl = None
    name = sts["metadata"]["labels"].get(NAME_LABEL, sts["metadata"]["name"])
    secret = _token(api, name) if ttl is not None else None
    if secret is None:
        return {"idle_s": None, "ttl_s": ttl}
    https = kube_tls.serves_tls(sts["spec"]["template"])  # the proxy's https:POD:PORT form
    url = api.proxy_url(f"{name}-0", port, https=https) + "/health"
    try:
        resp = http.get(url, headers={TOKEN_HEADER: bearer(secret)}, timeout=5.0)
        idle = resp.json().get("idle_s") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        logger.info("could not ask pod %s-0 how long it has been idle: %r", name, e)
        idle = None
    return {"idle_s": float(idle) if isinstance(idle, (int, float)) else None, "ttl_s": ttl}


def _token(api: KubeApi, name: str) -> str | None:
    """The deployment token, from its Secret (None where it is gone or unreadable)."""
    data = (api.get("Secret", token_secret_name(name)) or {}).get("data") or {}
    try:
        return base64.b64decode(data["token"]).decode() if "token" in data else None
    except ValueError:
        return None
