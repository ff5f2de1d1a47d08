"""Per-deployment TLS on Kubernetes: the manifests (the certificate and key in the token
Secret, mounted 0400 beside the token; the probe over HTTPS; schemas still valid), and on
the stand-in cluster (``kube_harness.py``: real pod servers behind a fake API server) the two
call paths: through the API server's pod proxy (``https:POD:PORT``) and in the cluster,
straight to the pods' IPs over TLS pinned to the certificate, where a relay on that hop reads
neither the token nor the arguments."""

from __future__ import annotations

import base64
import dataclasses
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
from kube_e2e import needs_root, stand_in_fixture
from tcp_relay import Relay

import ktlite as kt
from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_tls
from ktlite.backends.kube_api import load
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.modes import deploy
from ktlite.net import tls
from ktlite.net.client import PodClient
from ktlite.specs.deployment_spec import DeploymentSpec

TOKEN = "tls-token-" + "x" * 30
IMAGE = "python:3.11-slim"


def _render(compute: kt.Compute, token: str | None = TOKEN) -> list[dict[str, Any]]:
    spec = DeploymentSpec(name="tlsd", pod=compute.pod_spec())
    return km.render(spec, "default", image=IMAGE, install="ktlite==0.1.0", token=token, secrets=[])


def _kind(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind)


def test_the_manifests_ship_the_certificate_beside_the_token_and_probe_over_https() -> None:
    objs = _render(kt.Compute(cpus=1, backend="kubernetes"))
    secret = _kind(objs, "Secret")
    identity = tls.identity(TOKEN)
    assert base64.b64decode(secret["data"]["tls.crt"]) == identity.cert_pem
    assert base64.b64decode(secret["data"]["tls.key"]) == identity.key_pem
    # the same bytes from the same token (an unchanged deployment rewrites no Secret)
    assert _kind(_render(kt.Compute(cpus=1, backend="kubernetes")), "Secret") == secret
    pod = _kind(objs, "StatefulSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volume = {v["name"]: v for v in pod["volumes"]}["ktlite-token"]["secret"]
    assert volume["defaultMode"] == 0o400  # token, certificate and key: the server's alone
    assert {"key": "tls.key", "path": "tls.key"} in volume["items"]
    assert {"key": "tls.crt", "path": "tls.crt"} in volume["items"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KTLITE_TLS_CERT_FILE"] == "/var/run/ktlite/token/tls.crt"
    assert env["KTLITE_TLS_KEY_FILE"] == "/var/run/ktlite/token/tls.key"
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert kube_tls.serves_tls({"spec": pod})
    for obj in objs:  # the schemas of the Kubernetes version the real suite runs on
        kubernetes_validate.validate(obj, "1.30", strict=True)
    # the key only in the Secret; the plan holds placeholders
    assert not [o for o in objs if o is not secret and "PRIVATE KEY" in json.dumps(o)]
    plan = _render(kt.Compute(cpus=1, backend="kubernetes"), token=None)
    assert _kind(plan, "Secret")["stringData"]["tls.key"] == tls.KEY_PLACEHOLDER
    assert "PRIVATE KEY" not in json.dumps(plan)


def test_tls_false_leaves_the_pods_plain() -> None:
    objs = _render(kt.Compute(cpus=1, backend="kubernetes", tls=False))
    assert not {"tls.crt", "tls.key"} & set(_kind(objs, "Secret")["data"])
    pod = _kind(objs, "StatefulSet")["spec"]["template"]["spec"]
    assert "scheme" not in pod["containers"][0]["readinessProbe"]["httpGet"]
    assert not kube_tls.serves_tls({"spec": pod})
    assert "KTLITE_TLS_CERT_FILE" not in {e["name"] for e in pod["containers"][0]["env"]}


def test_tls_true_is_refused_for_an_autoscaled_deployment() -> None:
    compute = kt.Compute(cpus=1, backend="kubernetes", tls=True).autoscale(min_scale=1)
    spec = DeploymentSpec(name="tlsd", pod=compute.served().pod_spec())
    with pytest.raises(kt.ConfigError, match="tls=True"):
        kube_tls.wanted(spec)


# ---- the stand-in cluster -------------------------------------------------------------------

_stand_in = stand_in_fixture()


def size(x: bytes, back: int = 0) -> int | bytes:
    """``x``'s length; with ``back``, that many bytes of it (a result over 1 MiB)."""
    return bytes([len(x)]) * back if back else len(x)


@pytest.fixture(scope="module")
def kubeconfig(stand_in: tuple[Path, Any]) -> Iterator[str]:
    root, _ = stand_in
    yield str(root / "kubeconfig")


def _compute(kubeconfig: str) -> kt.Compute:
    return kt.Compute(
        cpus=0.1, backend="kubernetes", kubeconfig_path=kubeconfig, launch_timeout=120
    ).distribute("spmd", workers=2)


@needs_root
@pytest.mark.timeout(400)
def test_calls_go_over_tls_through_the_proxy_and_in_the_cluster(
    kubeconfig: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "tls-e2e"
    remote = kt.fn(size, name=name).to(_compute(kubeconfig))
    http, info = load(kubeconfig)
    try:
        eps = remote.deployment.endpoints
        assert all(f"/pods/https:{ep.name}:32300/proxy" in ep.url for ep in eps)
        assert all(ep.peer_url.startswith("https://") for ep in eps)
        assert remote(b"abc") == [3, 3]  # through the proxy, then pod to pod over TLS
        for n in (1, 2, 3):  # large results, each in the file the last one left: each intact
            assert remote(b"x" * n, 3 << 20) == [bytes([n]) * (3 << 20)] * 2

        # the same deployment seen from inside the cluster: straight to the pod IPs
        inside = KubernetesBackend(http, dataclasses.replace(info, in_cluster=True))
        monkeypatch.setattr(deploy, "backend_of", lambda spec: inside)
        remote = kt.fn(size, name=name).to(_compute(kubeconfig))
        dep = remote.deployment
        assert dep.applied.http is None
        assert [ep.url for ep in dep.endpoints] == [ep.peer_url for ep in dep.endpoints]
        assert all(ep.url.startswith("https://") for ep in dep.endpoints)
        token = dep.applied.token
        eps = list(dep.applied.endpoints)
        pod0 = urlsplit(eps[0].url)
        relay = Relay(pod0.port or 0, pod0.hostname or "")
        try:
            dep.applied.endpoints = [
                dataclasses.replace(eps[0], url=f"https://127.0.0.1:{relay.port}"),
                *eps[1:],
            ]
            marker = b"SNIFF-ME-" + secrets.token_hex(8).encode()
            assert remote(marker) == [len(marker)] * 2
        finally:
            dep.applied.endpoints = eps
            relay.close()
        seen = relay.seen()
        assert relay.connections and seen
        assert token.encode() not in seen and marker not in seen and b"HTTP/1.1" not in seen
        # a client pinned to another deployment's certificate is refused by the pod
        with pytest.raises(kt.PodUnreachable, match="not this deployment's pod"):
            PodClient("another-" + token).health(eps[0].url)
    finally:
        remote.teardown()
        http.close()
