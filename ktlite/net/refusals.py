"""What a refusal means: the ktlite error of an answer the pod refused (classified by its
error code), and a proxy's answer that says the pod was not reached (502/503/504, or a
Kubernetes ``Status`` body: the API server answered, not the pod)."""

from __future__ import annotations

import httpx

from ktlite.errors import AuthError, KtliteError, NotDeployedError, PodUnreachable, ProtocolMismatch
from ktlite_wire.errors import ErrorCode

PROXY_ERRORS = (502, 503, 504)
# what the API server's proxy says when it cannot open a connection to the pod
_UNDELIVERED = (
    "dial tcp",
    "connect: ",
    "no route to host",
    "i/o timeout",
    "address not allowed",
    "not found",
)


def proxy_refusal(resp: httpx.Response) -> ProxyRefusal | None:
    """The error of a proxy that could not reach the pod (502/503/504, or a Kubernetes
    ``Status`` body: the API server answered, not the pod), else None."""
    if resp.status_code < 400:
        return None
    resp.read()
    if resp.status_code in PROXY_ERRORS:
        return ProxyRefusal(resp.status_code, resp.text)
    try:
        body = resp.json()
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("kind") == "Status":
        return ProxyRefusal(resp.status_code, str(body.get("message", resp.text)))
    return None


class ProxyRefusal(Exception):
    """A proxy between us and the pod could not reach it (the API server's pod proxy answers
    503 when it cannot connect, 400 "address not allowed" while the pod has no IP, 404 when
    no pod has the name: between a deleted pod and its replacement)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.text = status, text

    @property
    def undelivered(self) -> bool:
        """The proxy could not even connect to the pod (so the request never reached it)."""
        return any(sign in self.text for sign in _UNDELIVERED)


def raise_for_status(status: int, detail: str, url: str, code: str | None = None) -> None:
    """Raise the ktlite error for a refusal, classified by its error code (the HTTP status
    only where a proxy, not the pod, answered)."""
    if status < 400:
        return
    error = ErrorCode.parse(code)
    if error is ErrorCode.UNAUTHORIZED or (error is None and status == 401):
        raise AuthError(
            f"pod at {url} refused the deployment token (HTTP 401): {detail}; "
            "the deployment was probably re-created: call .to() again"
        )
    if error is ErrorCode.PROTOCOL_MISMATCH:
        raise ProtocolMismatch(detail)
    if error in (ErrorCode.NOT_DEPLOYED, ErrorCode.REDEPLOYED):
        raise NotDeployedError(detail)
    if error is ErrorCode.UNKNOWN_CALL:
        raise PodUnreachable(detail)
    if status in PROXY_ERRORS:
        raise PodUnreachable(
            f"pod at {url} is not reachable through the proxy (HTTP {status}): {detail[:300]}"
        )
    raise KtliteError(f"pod at {url} answered HTTP {status}: {detail}")
