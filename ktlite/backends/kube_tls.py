"""Pure: per-deployment TLS on Kubernetes (on unless ``Compute(tls=False)``).

- The deployment's certificate and key (:mod:`ktlite.net.tls`, made from its token) travel in
  the token Secret, as ``tls.crt`` and ``tls.key`` beside ``token``, and are mounted with it,
  files of mode 0400 in :data:`~ktlite.backends.kube_security.TOKEN_DIR` (the server reads
  them through ``KTLITE_TLS_CERT_FILE`` / ``KTLITE_TLS_KEY_FILE``). A plan shows placeholders.
- The pod server then serves only TLS: the kubelet's readiness probe asks ``scheme: HTTPS``
  (it does not verify certificates), a caller in the cluster and the pods among themselves
  connect to ``https://IP:PORT`` pinned to the certificate, and from outside the cluster the
  API server's pod proxy is asked for ``https:POD:PORT``. The API server does not verify the
  pod's certificate on that hop: it is encrypted, not authenticated (docs/tls.md).
- Autoscaled deployments (Knative's queue-proxy, a Service) reach their replicas in plain
  HTTP: they stay plain, and ``Compute(tls=True)`` is refused for them.

Whether a pod serves TLS is read back from the pod itself (:func:`serves_tls`), so a lookup
needs no spec.
"""

from __future__ import annotations

import base64
from typing import Any

from ktlite.backends.kube_security import TOKEN_DIR, TOKEN_VOLUME
from ktlite.errors import ConfigError
from ktlite.net import tls
from ktlite.specs.deployment_spec import DeploymentSpec

ON_BY_DEFAULT = True  # the backend's tls_default: Compute(tls=None) serves TLS
CERT_KEY, KEY_KEY = "tls.crt", "tls.key"  # their keys in the token Secret, and file names
CERT_FILE, KEY_FILE = f"{TOKEN_DIR}/{CERT_KEY}", f"{TOKEN_DIR}/{KEY_KEY}"


def wanted(spec: DeploymentSpec) -> bool:
    """Whether ``spec``'s pods serve TLS: ``Compute(tls=...)``, else :data:`ON_BY_DEFAULT`;
    never for an autoscaled deployment (ConfigError if asked)."""
    if spec.autoscale is not None:
        if spec.pod.tls:
            raise ConfigError(
                "Compute(tls=True) with autoscale() on Kubernetes: Knative's queue-proxy and "
                "the Service reach replicas in plain HTTP only; leave tls unset (or False) for "
                "served deployments"
            )
        return False
    return ON_BY_DEFAULT if spec.pod.tls is None else spec.pod.tls


def secret_data(token: str | None) -> dict[str, str]:
    """The token Secret's TLS entries as ``data`` (base64; the same bytes for the same token,
    so an unchanged deployment writes nothing), or for a plan (no token) as ``stringData``
    placeholders."""
    if token is None:
        return {CERT_KEY: tls.CERT_PLACEHOLDER, KEY_KEY: tls.KEY_PLACEHOLDER}
    identity = tls.identity(token)
    return {
        CERT_KEY: base64.b64encode(identity.cert_pem).decode(),
        KEY_KEY: base64.b64encode(identity.key_pem).decode(),
    }


def secure(pod: dict[str, Any]) -> None:
    """Make ``pod`` (a pod spec, already hardened: it mounts the token volume) serve TLS, in
    place: the certificate and key mounted beside the token, the server told where they
    are, the readiness probe over HTTPS."""
    for volume in pod["volumes"]:
        if volume["name"] == TOKEN_VOLUME:
            volume["secret"]["items"] += [
                {"key": CERT_KEY, "path": CERT_KEY},
                {"key": KEY_KEY, "path": KEY_KEY},
            ]
    container = pod["containers"][0]
    container["env"] += [
        {"name": "KTLITE_TLS_CERT_FILE", "value": CERT_FILE},
        {"name": "KTLITE_TLS_KEY_FILE", "value": KEY_FILE},
    ]
    probe = (container.get("readinessProbe") or {}).get("httpGet")
    if probe is not None:
        probe["scheme"] = "HTTPS"


def serves_tls(pod: dict[str, Any]) -> bool:
    """Whether a pod (an object of the API, or a template's) serves TLS: its probe says so."""
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or [{}]
    probe = (containers[0].get("readinessProbe") or {}).get("httpGet") or {}
    return str(probe.get("scheme", "HTTP")).upper() == "HTTPS"
