"""Admission: which requests the pod server takes, decided from the request head alone.

Every endpoint but ``/health`` needs the deployment token (``/metrics`` also takes it as
Prometheus sends one, ``authorization: Bearer <token>``); a request without it is answered
401 before anything of its body is read, and the connection is closed (the body is never
read). A client speaking another protocol version is answered 409, naming both. A body declared larger than its endpoint allows (``Limits.max_body`` for ``/call`` and
``/deploy``, ``Limits.max_small_body`` for the rest, which take none) is answered 413 the same
way.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping
from typing import Any

from ktlite_server.connections import Limits
from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import (
    ERROR_CODE_HEADER,
    LENGTH_HEADER,
    TOKEN_HEADER,
    VERSION_HEADER,
    bearer,
)
from ktlite_wire.version import PROTOCOL_VERSION, RELEASE, mismatch

PUBLIC = frozenset({"/health"})
LARGE_BODIES = frozenset({"/call", "/deploy"})

_TOKEN = TOKEN_HEADER.encode()
_LENGTH = LENGTH_HEADER.encode()
_VERSION = VERSION_HEADER.encode()
_OURS = str(PROTOCOL_VERSION).encode()


class Token:
    """The deployment token, compared in constant time; never shown."""

    def __init__(self, token: str) -> None:
        self._expected = bearer(token).encode()

    def __repr__(self) -> str:
        return "Token(<hidden>)"

    def matches(self, header: bytes | None) -> bool:
        return hmac.compare_digest(header or b"", self._expected)

    def in_scope(self, scope: Mapping[str, Any]) -> bool:
        """Whether the request of this ASGI scope carries the token."""
        return self.matches(next((v for k, v in scope["headers"] if k == _TOKEN), None))


async def refuse(send: Any, status: int, detail: str, code: ErrorCode) -> None:
    """Answer ``status`` with a JSON ``detail`` and ``code`` (``x-ktlite-error``), and close the
    connection (its body unread)."""
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                (ERROR_CODE_HEADER.encode(), code.value.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Gate:
    """ASGI middleware in front of the pod server's app: the token, then the declared size.

    The data store's server reuses it with its own paths (a subclass naming them).
    """

    public: frozenset[str] = PUBLIC  # answered without the token
    large_bodies: frozenset[str] = LARGE_BODIES  # up to ``Limits.max_body``; the rest take none
    large_prefixes: tuple[str, ...] = ("/ports/",)  # a pod's own apps' requests (portproxy)
    # looking at a pod is not using it: a dashboard or a Prometheus scraper polling these must
    # not keep a deployment past its inactivity_ttl
    observing: frozenset[str] = frozenset({"/status", "/metrics"})
    token_name = "deployment token"  # in the 401
    body_limit_name = "KTLITE_MAX_BODY"  # in the 413 of a large-body path

    def __init__(
        self,
        app: Any,
        token: Token,
        limits: Limits,
        on_admit: Callable[[], None] = lambda: None,
        pod_name: str = "this pod",
    ) -> None:
        self.app = app
        self.pod_name = pod_name  # named in a version clash
        self.token = token
        self.limits = limits
        self.on_admit = on_admit  # called for each request that carries the token, but observing

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        head = dict(scope["headers"])  # in C: cheaper than a loop over the pairs here
        token, version = head.get(_TOKEN), head.get(_VERSION)
        if token is None and path == "/metrics":  # a scraper's own `authorization: Bearer`
            token = head.get(b"authorization")
        length, chunked_length = head.get(b"content-length"), head.get(_LENGTH)
        if path not in self.public:
            if not self.token.matches(token):
                await refuse(
                    send, 401, f"missing or wrong {self.token_name}", ErrorCode.UNAUTHORIZED
                )
                return
            if path not in self.observing:
                self.on_admit()
            if version is not None and version != _OURS:
                theirs = version[:20].decode("latin-1")
                await refuse(
                    send,
                    409,
                    mismatch(
                        theirs,
                        them="the client",
                        us=f"pod {self.pod_name}'s server (ktlite {RELEASE})",
                    ),
                    ErrorCode.PROTOCOL_MISMATCH,
                )
                return
        declared = length or chunked_length  # a chunked body (through a proxy) names its length
        if declared is not None and declared.isdigit():
            large = path in self.large_bodies or path.startswith(self.large_prefixes)
            limit = self.limits.max_body if large else self.limits.max_small_body
            if int(declared) > limit:
                what = self.body_limit_name if large else f"{path} takes no body"
                await refuse(
                    send,
                    413,
                    f"body of {int(declared)} bytes is larger than this server's limit "
                    f"of {limit} bytes ({what})",
                    ErrorCode.TOO_LARGE,
                )
                return
        await self.app(scope, receive, send)
