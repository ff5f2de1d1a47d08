"""Pure: a :class:`DeploymentSpec` → the Kubernetes objects that run it (plain dicts).

Per deployment NAME: a Secret ``NAME-token`` (the call token, a file on the pods), a headless
Service ``NAME`` (``publishNotReadyAddresses``: peers are reachable before they report ready),
one PVC per ``kt.Volume``, a NetworkPolicy ``NAME`` (the server's port open, every other port to
the deployment's own pods only), and a StatefulSet ``NAME`` (Parallel pod management: all pods start at once;
``OnDelete`` updates: the backend decides which pods to replace). Everything carries
``ktlite.dev/name=NAME`` so list and teardown find it. Each secret given by value or preset
(``Compute(secrets=["aws", kt.secret(...)])``) is a Secret ``NAME-secret-KEY`` (labelled
``ktlite.dev/secret=KEY`` too); plans hold placeholders, never values.

Pods of different sizes (a GPU deployment with ``num_proc=[4, 8, 2]``: 4, 8 and 2 GPUs) cannot
share a pod template, so such a deployment has one StatefulSet per run of pods of one size:
``NAME`` for the run that starts at pod 0 and ``NAME-sK`` for the run starting at pod K, whose
``spec.ordinals.start`` is K. Ordinals stay global and stable (pod 2 is ``NAME-s2-2``, with
``apps.kubernetes.io/pod-index=2``); each StatefulSet selects its pods by a ``ktlite.dev/part=K``
label as well.

The objects' names and labels are :mod:`ktlite.backends.kube_labels`', their pod template
:mod:`ktlite.backends.kube_pod_template`'s; the names of both that the backend and its tests
read are re-exported here, so a plan's vocabulary is read from one module.
"""

from __future__ import annotations

import base64
import copy
import sys
from typing import Any

from ktlite.backends import kube_boot, kube_tls
from ktlite.backends import kube_expiry as kexp
from ktlite.backends.kube_labels import (
    GPU_MEMORY_ANNOTATION,
    HASH_ANNOTATION,
    MANAGED_LABELS,
    NAME_LABEL,
    PART_LABEL,
    QUEUE_LABEL,
    SECRET_LABEL,
    SECRETS_ANNOTATION,
    labels,
    queue_label,
    selector,
    template_hash,
    token_secret_name,
    user_secret_name,
)
from ktlite.backends.kube_pod_template import (
    BOOTSTRAP,
    CONTAINER,
    SERVER_PORT,
    SETUP_FAILED_EXIT,
    STATE_DIR,
    TOKEN_PLACEHOLDER,
    master_port,
    part_selector,
    parts,
    pod_template,
    resolve_secrets,
    setup_steps,
)
from ktlite.config import get as setting
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.secrets import Resolved
from ktlite.specs.volume import Volume

__all__ = [
    "BOOTSTRAP",
    "CONTAINER",
    "GPU_MEMORY_ANNOTATION",
    "HASH_ANNOTATION",
    "MANAGED_LABELS",
    "NAME_LABEL",
    "PART_LABEL",
    "QUEUE_LABEL",
    "SECRETS_ANNOTATION",
    "SECRET_LABEL",
    "SERVER_PORT",
    "SETUP_FAILED_EXIT",
    "STATE_DIR",
    "TOKEN_PLACEHOLDER",
    "default_image",
    "install_spec",
    "labels",
    "master_port",
    "merge_template",
    "network_policy",
    "part_selector",
    "parts",
    "pod_template",
    "queue_label",
    "render",
    "resolve_secrets",
    "secret_objects",
    "selector",
    "template_hash",
    "token_secret_name",
    "user_secret_name",
]


def secret_objects(
    name: str, namespace: str, secrets: list[Resolved], token: str | None
) -> list[dict[str, Any]]:
    """A Secret per secret given by value; without ``token`` (a plan) placeholders hold the
    place of each value: how many bytes, from where."""
    out = []
    for r in secrets:
        if r.existing:
            continue
        meta = {
            "name": user_secret_name(name, r.key),
            "namespace": namespace,
            "labels": {**labels(name), SECRET_LABEL: r.key},
        }
        obj: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": meta,
        }
        if token is None:
            obj["stringData"] = r.placeholders()
        else:
            obj["data"] = {k: base64.b64encode(v).decode() for k, v in r.data().items()}
        out.append(obj)
    return out


def render(
    spec: DeploymentSpec,
    namespace: str,
    *,
    image: str,
    install: str,
    token: str | None = None,
    secrets: list[Resolved] | None = None,
) -> list[dict[str, Any]]:
    """Every object deploying ``spec`` applies, in apply order. Without ``token`` the Secrets
    hold placeholders (plans are printed; tokens and secret values never are). ``secrets``:
    the Compute's, read (default: read now)."""
    name = spec.name
    if secrets is None:
        secrets = resolve_secrets(spec, namespace)
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels(name)}
    secret: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {**meta, "name": token_secret_name(name)},
        "stringData": {"token": token if token is not None else TOKEN_PLACEHOLDER},
    }
    boot = kube_boot.secret_data(setup_steps(spec), token)  # placeholders in a plan
    if kube_tls.wanted(spec):  # the deployment's TLS certificate and key, made from the token
        boot.update(kube_tls.secret_data(token))
    if token is None:
        secret["stringData"].update(boot)
    else:
        secret["data"] = boot
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {NAME_LABEL: name},
            "ports": [
                {"name": "server", "port": SERVER_PORT, "targetPort": SERVER_PORT},
                {"name": "master", "port": master_port(spec), "targetPort": master_port(spec)},
            ],
        },
    }
    claims = []
    for vol in spec.pod.volumes:
        if isinstance(vol, Volume):
            claim_spec: dict[str, Any] = {
                "accessModes": [vol.access_mode],
                "resources": {"requests": {"storage": vol.size}},
            }
            if vol.storage_class:
                claim_spec["storageClassName"] = vol.storage_class
            if vol.volume_name:
                claim_spec["volumeName"] = vol.volume_name
            claims.append(
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": {**meta, "name": vol.name},
                    "spec": claim_spec,
                }
            )
    statefulsets = []
    for part in parts(spec):
        sts_spec: dict[str, Any] = {
            "serviceName": name,
            "replicas": part.replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": part_selector(name, part)},
            "template": pod_template(
                spec, image=image, install=install, part=part, secrets=secrets, token=token
            ),
        }
        if part.start:
            sts_spec["ordinals"] = {"start": part.start}
        sts: dict[str, Any] = {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {
                **meta,
                "name": part.name,
                "labels": {**queue_label(spec.pod), **meta["labels"]},
            },
            "spec": sts_spec,
        }
        if kexp.ttl_seconds(spec) is not None:  # read by a client's sweep
            sts["metadata"]["annotations"] = {kexp.TTL_ANNOTATION: f"{kexp.ttl_seconds(spec):g}"}
        if spec.pod.kubernetes.service_template:
            sts = _with_template(sts, spec.pod.kubernetes.service_template)
        statefulsets.append(sts)
    users = secret_objects(name, namespace, secrets, token)
    access = kexp.access_objects(spec, namespace, [p.name for p in parts(spec)], secrets)
    return [secret, service, *users, *claims, network_policy(name, meta), *access, *statefulsets]


def _with_template(sts: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``Compute(service_template=...)`` merged into a StatefulSet. ktlite's labels, selector
    and name stay its own (teardown and pod lookup use them), and the pod hash is taken again
    over the merged pod template, so a changed template replaces the pods."""
    merged = merge_template(sts, extra)
    merged["metadata"] = {
        **merged["metadata"],
        "name": sts["metadata"]["name"],
        "namespace": sts["metadata"]["namespace"],
        "labels": {**merged["metadata"].get("labels", {}), **sts["metadata"]["labels"]},
    }
    merged["spec"]["selector"] = sts["spec"]["selector"]
    template = merged["spec"]["template"]
    own = sts["spec"]["template"]["metadata"]["labels"]
    template["metadata"]["labels"] = {**template["metadata"].get("labels", {}), **own}
    annotations = dict(template["metadata"].get("annotations") or {})
    annotations.pop(HASH_ANNOTATION, None)
    template["metadata"]["annotations"] = annotations
    annotations[HASH_ANNOTATION] = template_hash(template)
    return merged


def merge_template(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` merged deeply into ``base``: dicts merge, anything else in ``extra`` replaces."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_template(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def network_policy(
    name: str, meta: dict[str, Any], open_ports: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Every deployment's: its pods' ports are reachable from the deployment's own pods only
    (the rendezvous ``MASTER_PORT`` and the TCPStore, gloo and NCCL, Ray's and Monarch's
    ports, none of which authenticates), but for ktlite's server, which asks every caller for
    the deployment token, and ``open_ports`` (a Knative queue-proxy's). Egress is left alone.
    Enforced only where the cluster's network plugin enforces NetworkPolicies; a pod of the
    same namespace that carries the deployment's name label passes it."""
    ports = [{"protocol": "TCP", "port": port} for port in (SERVER_PORT, *open_ports)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": {NAME_LABEL: name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": ports},
                {"from": [{"podSelector": {"matchLabels": {NAME_LABEL: name}}}]},
            ],
        },
    }


def default_image() -> str:
    """The pods' image where the Compute names none: ``ktlite config``'s, else this Python's slim one."""
    return setting("image") or f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"


def install_spec() -> str:
    """What a pod installs from the package index instead of running the client's shipped
    source: ``ktlite config``'s install (``KTLITE_INSTALL``), else nothing."""
    return setting("install") or ""
