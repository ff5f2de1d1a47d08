"""ServiceAccount tokens and RBAC for the fake API server (``kube_fake.FakeKube``).

The fake's own token is an administrator's, as before. A token issued here for a
ServiceAccount (:meth:`ServiceAccountTokens.issue`, as the kubelet's projected token) is
authenticated while that ServiceAccount exists with the uid it was issued for (a deleted
account's token gets 401, as a bound token does), and authorized by the Roles that the
namespace's RoleBindings give the account, as the API server's RBAC authorizer does: a rule
matches on its API groups, resources (``pods/log`` for a subresource), verbs (``get``,
``list``, ``create``, ``update``, ``patch``, ``delete``, ``deletecollection``; ``*`` for
any) and, where it has ``resourceNames``, only requests that name one of them (so never a
list or a create). What no rule allows is answered 403 with the API server's message.
ClusterRoles and ClusterRoleBindings are not served: an account has its Roles only.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
_PATH = re.compile(
    r"/(?:api/v1|apis/([^/]+)/[^/]+)(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/:]+)[^/]*(?:/(\w+))?)?.*"
)


class ServiceAccountTokens:
    """Tokens the fake issued for ServiceAccounts: token -> (namespace, name, uid)."""

    def __init__(self) -> None:
        self._tokens: dict[str, tuple[str, str, str]] = {}

    def issue(self, namespace: str, name: str, uid: str) -> str:
        token = "sa-" + secrets.token_urlsafe(24)
        self._tokens[token] = (namespace, name, uid)
        return token

    def who(self, authorization: str | None) -> tuple[str, str, str] | None:
        """(namespace, name, uid) of the account whose token ``authorization`` carries."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self._tokens.get(authorization[7:])


def request_attributes(method: str, path: str) -> tuple[str, str, str, str | None, str | None]:
    """(verb, API group, resource, namespace, name) of a request, as RBAC sees it."""
    m = _PATH.fullmatch(path)
    if m is None:
        return _VERBS.get(method, method.lower()), "", "", None, None
    group, namespace, resource, name, sub = m.groups()
    verb = _VERBS.get(method, method.lower())
    if name is None:
        verb = {"get": "list", "delete": "deletecollection"}.get(verb, verb)
    if "/proxy" in path:
        sub = "proxy"
    return verb, group or "", f"{resource}/{sub}" if sub else resource, namespace, name


def forbidden(
    store: Mapping[tuple[str, str, str], Obj], account: tuple[str, str, str], method: str, path: str
) -> str | None:
    """None where the account's Roles allow the request; else the API server's 403 message."""
    sa_ns, sa_name, _ = account
    verb, group, resource, namespace, name = request_attributes(method, path)
    if namespace is not None:
        for (res, ns, _), binding in store.items():
            if res != "rolebindings" or ns != namespace:
                continue
            subjects = binding.get("subjects") or []
            if not any(
                s.get("kind") == "ServiceAccount"
                and s.get("name") == sa_name
                and s.get("namespace", ns) == sa_ns
                for s in subjects
            ):
                continue
            ref = binding.get("roleRef") or {}
            role = (
                store.get(("roles", ns, ref.get("name", ""))) if ref.get("kind") == "Role" else None
            )
            if role is not None and any(
                _matches(rule, verb, group, resource, name) for rule in role.get("rules") or []
            ):
                return None
    user = f"system:serviceaccount:{sa_ns}:{sa_name}"
    qualified = resource.split("/")[0] + (f".{group}" if group else "")
    where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    subject = f'{qualified} "{name}" is forbidden' if name else f"{qualified} is forbidden"
    return (
        f'{subject}: User "{user}" cannot {verb} resource "{resource}" in API group '
        f'"{group}"{where}'
    )


def _matches(rule: Obj, verb: str, group: str, resource: str, name: str | None) -> bool:
    def has(key: str, value: str) -> bool:
        values = rule.get(key) or []
        return "*" in values or value in values

    if not (has("apiGroups", group) and has("resources", resource) and has("verbs", verb)):
        return False
    names = rule.get("resourceNames") or []
    return not names or (name is not None and name in names)
