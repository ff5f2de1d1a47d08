"""A deployment's Secrets on the cluster: the token Secret, and the Secrets of the user's
values (``Compute(secrets=[...])``), made, updated and dropped with the deployment."""

from __future__ import annotations

import base64
import contextlib
from typing import Any

from ktlite.backends import kube_deps
from ktlite.backends import kube_manifests as km
from ktlite.backends.kube_api import KubeApi
from ktlite.errors import ConfigError
from ktlite.specs.secrets import Resolved


def check_user_secrets(
    api: KubeApi, name: str, objects: list[dict[str, Any]], resolved: list[Resolved]
) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each Secret of the user's values with the one there now (None: absent); ConfigError,
    before anything is made, for an existing Secret named alone that is not there, and for
    a Secret of ours that another owner has (unless its ``override=True``)."""
    override = {km.user_secret_name(name, r.key): r.secret.override for r in resolved}
    for r in resolved:
        if r.existing and api.get("Secret", r.existing) is None:
            raise ConfigError(
                f"secrets names Kubernetes Secret {r.existing!r}, which does not exist in "
                f"namespace {api.namespace!r}; create it (kubectl -n {api.namespace} create "
                f"secret generic {r.existing} --from-literal=KEY=VALUE), or name a provider "
                "preset or kt.secret(...) with values"
            )
    out = []
    for obj in objects:
        if obj["kind"] != "Secret" or km.SECRET_LABEL not in obj["metadata"]["labels"]:
            continue
        current = api.get("Secret", obj["metadata"]["name"])
        owner = ((current or {}).get("metadata", {}).get("labels") or {}).get(km.NAME_LABEL)
        if current is not None and owner != name and not override[obj["metadata"]["name"]]:
            key = obj["metadata"]["labels"][km.SECRET_LABEL]
            raise ConfigError(
                f"Kubernetes Secret {obj['metadata']['name']!r} already exists in namespace "
                f"{api.namespace!r} and deployment {name!r} did not make it; pass "
                f"kt.secret(..., override=True) to replace its data (secret {key!r}), or give "
                "the secret another name="
            )
        out.append((obj, current))
    return out


def apply_user_secret(
    api: KubeApi,
    obj: dict[str, Any],
    current: dict[str, Any] | None,
    created: list[tuple[str, str]],
) -> None:
    if current is None:
        api.create(obj)
        created.append(("Secret", obj["metadata"]["name"]))
    elif (
        current.get("data") != obj["data"]
        or (current["metadata"].get("labels") or {}) != obj["metadata"]["labels"]
    ):
        api.replace(obj, current["metadata"]["resourceVersion"])


def drop_stale_secrets(api: KubeApi, name: str, keep: set[str]) -> None:
    """Delete the Secrets of values this deployment no longer names."""
    for obj in api.list("Secret", km.selector(name)):
        meta = obj["metadata"]
        if km.SECRET_LABEL in (meta.get("labels") or {}) and meta["name"] not in keep:
            api.delete("Secret", meta["name"])


def apply_token_secret(
    api: KubeApi, secret: dict[str, Any], token: str, created: list[tuple[str, str]]
) -> bool:
    """Create or update the token Secret (the token, the boot files of ``kube_boot``, the TLS
    certificate and key of ``kube_tls``);
    True if running pods may hold another token (a missing Secret counts: its pods started
    with the deleted one's). Changed boot files alone do not count: the pods' spec names
    their digests, so the pods that need them are replaced anyway."""
    kube_deps.ensure(api)  # the server's packages, for pods whose image lacks them
    current = api.get("Secret", secret["metadata"]["name"])
    if current is None:
        api.create(secret)
        created.append(("Secret", secret["metadata"]["name"]))
        return True
    same_token = decode_token(current) == token
    held = {k: v for k, v in (current.get("data") or {}).items() if k != "token"}
    if same_token and held == (secret.get("data") or {}):
        return False
    api.replace(secret, current["metadata"]["resourceVersion"])
    return not same_token


def decode_token(secret: dict[str, Any]) -> str | None:
    data = secret.get("data") or {}
    if "token" in data:
        with contextlib.suppress(ValueError):
            return base64.b64decode(data["token"]).decode()
    string_data: str | None = (secret.get("stringData") or {}).get("token")
    return string_data
