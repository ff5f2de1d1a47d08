"""A Kubernetes pod server deleting its own deployment once ``inactivity_ttl`` has passed.

The client gives a deployment with an ``inactivity_ttl`` a ServiceAccount of its own whose
Role may get its StatefulSets and delete only its own objects, by name. Its token reaches the
server as a projected file (:data:`TOKEN_FILE`, refreshed by the kubelet, read again for every
request), with the cluster's CA beside it. The objects to delete come in
``KTLITE_TEARDOWN_PATHS``: the API paths (``{namespace}`` standing for the pod's own,
``KTLITE_NAMESPACE``) in the order to delete them (the StatefulSets first,
so no pod is restarted, then the Service, the Secrets and the NetworkPolicy, and last the
ServiceAccount, which owns the Role and RoleBinding: the garbage collector removes those).

Plain ``urllib`` (a pod image may lack the ``kubernetes`` package). Where the API server
cannot be reached (a cluster without kube-proxy, whose ``kubernetes`` Service has no
endpoints) :meth:`SelfTeardown.run` says why and the server keeps serving; a client's
``ktlite list`` or ``ktlite teardown --expired`` then removes the deployment.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

API_DIR = "/var/run/ktlite/api"  # the projected volume: token and ca.crt
TOKEN_FILE = f"{API_DIR}/token"
CA_FILE = f"{API_DIR}/ca.crt"
PATHS_ENV = "KTLITE_TEARDOWN_PATHS"
API_URL_ENV = "KTLITE_KUBE_API"  # where the API server is, if not the in-cluster Service's
TIMEOUT_S = 5.0  # per request: an API server that does not answer must not hold the pod


class TeardownError(Exception):
    """The deployment's objects could not all be deleted; the message says which and why."""


@dataclass(frozen=True)
class SelfTeardown:
    """The API server's address, the objects' paths in deletion order, and the files."""

    api: str
    paths: tuple[str, ...]
    token_file: str = TOKEN_FILE
    ca_file: str = CA_FILE
    timeout: float = TIMEOUT_S
    _context: list[ssl.SSLContext] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def from_env(cls) -> SelfTeardown | None:
        """The pod's own, or None where it has none (no token file mounted: the deployment has
        no inactivity_ttl, or its pods run under the user's ServiceAccount)."""
        raw = os.environ.get(PATHS_ENV)
        if not raw or not os.path.exists(TOKEN_FILE):
            return None
        namespace = os.environ.get("KTLITE_NAMESPACE", "default")
        try:
            paths = tuple(str(p).replace("{namespace}", namespace) for p in json.loads(raw))
        except ValueError:
            logger.error("%s is not a JSON list of API paths; no self-teardown", PATHS_ENV)
            return None
        api = os.environ.get(API_URL_ENV)
        if not api:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            api = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(api.rstrip("/"), paths)

    def run(self) -> list[str]:
        """Delete the objects in order; returns the paths deleted (those already gone are
        skipped). Raises :class:`TeardownError` at the first that fails, naming it."""
        head = next((p for p in self.paths if "/statefulsets/" in p), None)
        if head is not None and self._request("GET", head) == 404:
            return []  # gone already: a client swept it, or someone tore it down
        deleted = []
        for path in self.paths:
            if self._request("DELETE", path) != 404:
                deleted.append(path)
        return deleted

    def _request(self, method: str, path: str) -> int:
        body = (
            json.dumps({"propagationPolicy": "Background"}).encode() if method == "DELETE" else None
        )
        try:
            with open(self.token_file, encoding="utf-8") as f:  # rotated by the kubelet
                token = f.read().strip()
        except OSError as e:
            raise TeardownError(f"cannot read the ServiceAccount token: {e.strerror}") from None
        request = urllib.request.Request(
            self.api + path,
            data=body,
            method=method,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._ssl()) as resp:
                resp.read()
                return int(resp.status)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return 404
            detail = _message(e.read())
            raise TeardownError(f"{method} {path}: HTTP {e.code}: {detail}") from None
        except (OSError, ValueError) as e:  # URLError, timeouts, refused connections, TLS
            reason = getattr(e, "reason", None) or e
            raise TeardownError(
                f"the Kubernetes API at {self.api} could not be reached ({reason})"
            ) from None

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.api.startswith("https:"):
            return None
        if not self._context:
            cafile = self.ca_file if os.path.exists(self.ca_file) else None
            self._context.append(ssl.create_default_context(cafile=cafile))
        return self._context[0]


def _message(body: bytes) -> str:
    """A Kubernetes Status body's message, else the body's start."""
    try:
        return str(json.loads(body).get("message", ""))[:300]
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", "replace")
