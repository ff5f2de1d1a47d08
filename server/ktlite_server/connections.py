"""The pod server's connections: what a client may hold, and for how long.

uvicorn's ``httptools`` protocol, with the limits it lacks:

- a request head (request line and headers) larger than ``Limits.max_head`` is answered
  431 and the connection closed, before the parser sees more than that many bytes
  (httptools itself takes a header of any size, and joins its pieces in quadratic time);
- a head that is not complete ``Limits.header_timeout`` seconds after its first byte (or
  after the connection opened) is answered 408 and the connection closed (slowloris);
- a keep-alive connection idle for ``Limits.idle_timeout`` seconds is closed (uvicorn's own
  keep-alive timer);
- at most ``Limits.max_connections`` connections are open. A new one past the cap takes
  the place of the connection that has waited longest without a request in progress (a
  head still arriving, or idle between requests): a running call's connection is never
  closed for it, and a ``/health`` still gets in while idle or slow clients hold every
  slot. When every connection carries a request, the new one is answered 503 with the
  reason.

The cap is also kept under the process's open-file limit, so held connections cannot take
the descriptors the server needs for its ranks, shared-memory files and peers.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ktlite_server import callresponse, directbody, linkserver

logger = logging.getLogger(__name__)

# descriptors the server keeps for itself (rank pipes, shared-memory files, peer connections,
# logs) out of a low open-file limit
FD_RESERVE = 64


@dataclass(frozen=True)
class Limits:
    """What one client may send and hold; each field has a ``KTLITE_*`` variable."""

    # KTLITE_MAX_HEADER_BYTES: request line + headers. A call's plan travels in a header and
    # grows with the pods (their addresses and names) and per-rank items: 256 KiB holds a
    # thousand pods' plan, and parsing that much costs httptools about a millisecond.
    max_head: int = 256 << 10
    header_timeout: float = 15.0  # KTLITE_HEADER_TIMEOUT: seconds to send a complete head
    idle_timeout: float = 75.0  # KTLITE_IDLE_TIMEOUT: a keep-alive connection with no request
    max_connections: int = 1024  # KTLITE_MAX_CONNECTIONS (and below the open-file limit)
    max_body: int = 8 << 30  # KTLITE_MAX_BODY: a /call or /deploy body
    max_small_body: int = 64 << 10  # the body of any other endpoint (they take none)

    _ENV = {
        "max_head": "KTLITE_MAX_HEADER_BYTES",
        "header_timeout": "KTLITE_HEADER_TIMEOUT",
        "idle_timeout": "KTLITE_IDLE_TIMEOUT",
        "max_connections": "KTLITE_MAX_CONNECTIONS",
        "max_body": "KTLITE_MAX_BODY",
    }

    def __post_init__(self) -> None:
        for name in ("max_head", "max_connections", "max_body", "max_small_body"):
            if int(getattr(self, name)) < 1:
                raise ValueError(
                    f"{self._ENV.get(name, name)}={getattr(self, name)!r}: must be a positive integer"
                )
        for name in ("header_timeout", "idle_timeout"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(
                    f"{self._ENV[name]}={getattr(self, name)!r}: must be a positive number of seconds"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Limits:
        """The defaults, with each ``KTLITE_*`` variable that is set in ``environ``."""
        kwargs: dict[str, Any] = {}
        for field, var in cls._ENV.items():
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            kind = float if field.endswith("timeout") else int
            try:
                kwargs[field] = kind(raw)
            except ValueError:
                raise ValueError(
                    f"{var}={raw!r}: must be a {'number of seconds' if kind is float else 'whole number'}"
                ) from None
        return cls(**kwargs)

    def connection_cap(self) -> int:
        """``max_connections``, lowered to half of what the open-file limit leaves."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(8, min(self.max_connections, (soft - FD_RESERVE) // 2))


def _answer(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounded heads, a header timeout and a connection cap.

    ``limits`` and ``cap`` are class attributes: uvicorn builds one protocol per connection
    from the class (:func:`guarded` makes a subclass per server).
    """

    limits: Limits = Limits()
    cap: int = Limits().max_connections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head: int | None = 0  # bytes of the request head so far; None once it is complete
        self._head_timer: Any = None
        now = time.monotonic()
        self._waiting_since: float | None = now  # no request in progress since
        # when the head being awaited began (its first byte, or the connection opening); None
        # while no head is awaited. The timer is lazy: a complete head does not cancel it, it
        # finds nothing to do when it fires (a timer per request cost more than the rest of
        # this class on a warm call)
        self._head_began: float | None = now
        self._lost = callresponse.Lost()  # the current call response's disconnect hook
        self._extensions: dict[str, Any] = {
            directbody.BODY_INTO: functools.partial(directbody.receive_into, self),
            directbody.WRITE_CHUNK: functools.partial(directbody.write_chunk, self),
            callresponse.RAW_RESPONSE: functools.partial(callresponse.open_raw, self, self._lost),
            linkserver.TAKE_OVER: functools.partial(linkserver.take_over, self),
        }

    # -- the connection cap ------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.cap and not self._evict_one():
            logger.info(
                "refused a connection: %d open, every one carries a request (cap %d)",
                len(self.connections) - 1,
                self.cap,
            )
            transport.write(
                _answer(
                    503,
                    "Service Unavailable",
                    f"this pod server has {len(self.connections) - 1} connections open, each "
                    f"carrying a request (the limit is {self.cap}: KTLITE_MAX_CONNECTIONS, and "
                    "half of what the open-file limit leaves); retry shortly",
                )
            )
            self._close()
            return
        self._arm_head_timer()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest with no request in progress."""
        oldest: GuardedHttpTools | None = None
        for conn in self.connections:
            if (
                conn is self
                or not isinstance(conn, GuardedHttpTools)
                or conn._waiting_since is None
            ):
                continue
            if conn.transport is None or conn.transport.is_closing():
                continue
            if oldest is None or conn._waiting_since < oldest._waiting_since:  # type: ignore[operator]
                oldest = conn
        if oldest is None:
            return False
        logger.debug("connection cap %d reached: closed the connection waiting longest", self.cap)
        oldest._close()
        return True

    def _close(self) -> None:
        self._cancel_head_timer()
        self.connections.discard(self)  # gone at once, not when the transport reports it
        if not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
        self._lost()  # a call response written by the server itself learns of it here

    def shutdown(self) -> None:
        """The server stops (SIGTERM, teardown): an idle connection whose output is all sent
        is dropped at once. uvicorn closes it, and over TLS a close waits for the peer's
        close_notify, which an idle peer (the caller's pooled connection, another pod's)
        never sends: every TLS server waited out its whole graceful timeout (3 s)."""
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.get_write_buffer_size():
            self.connections.discard(self)
            self.transport.abort()
            return
        super().shutdown()

    # -- the request head: size and time -----------------------------------------------------

    def data_received(self, data: bytes) -> None:
        head = self._head
        if head is None:  # a body (or a response being sent): no head limit applies
            super().data_received(data)
            return
        if head + len(data) <= self.limits.max_head:  # the usual case: one piece, no copy
            self._head = head + len(data)
            super().data_received(data)
            return
        while data:
            if self._head is None:  # a body (or a response being sent): no head limit applies
                super().data_received(data)
                return
            room = self.limits.max_head - self._head
            if room <= 0:
                self._refuse_head()
                return
            if len(data) <= room:  # the usual case: no copy
                piece, data = data, b""
            else:
                piece, data = data[:room], data[room:]
            self._head += len(piece)
            super().data_received(piece)
            if self.transport.is_closing():
                return

    def _refuse_head(self) -> None:
        logger.info(
            "refused a request head over %d bytes (KTLITE_MAX_HEADER_BYTES)", self.limits.max_head
        )
        self.transport.write(
            _answer(
                431,
                "Request Header Fields Too Large",
                f"the request line and headers are over {self.limits.max_head} bytes, this "
                "server's limit (KTLITE_MAX_HEADER_BYTES)",
            )
        )
        self._close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if (
            self._head is None
        ):  # a request right after a body not yet counted (pipelined, or refused)
            self._head = 0
        if self._head_began is None:  # else: counted since the connection opened
            self._head_began = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = self._head_began
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._head = None
        self._waiting_since = self._head_began = None
        super().on_headers_complete()
        if self.scope.get("method") == "POST":
            # large bodies past uvicorn's copies, both ways (one dict for the connection: a
            # warm call pays for an assignment, the rest only a large body does)
            self.scope["extensions"] = self._extensions

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if pipelined or self._head is not None or (self.cycle is not None and self.cycle.more_body):
            # a request queued behind this one, the next head already arriving (counted since
            # its first byte), or this request's body still arriving: not idle
            return
        self._head = 0
        self._waiting_since = time.monotonic()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and self._head is None:
            # the body ended after its answer (a refused upload): idle from now, and bounded,
            # since uvicorn's keep-alive timer was cancelled by the body's arrival
            self._head = 0
            self._waiting_since = self._head_began = time.monotonic()
            self._arm_head_timer()

    def _arm_head_timer(self, delay: float | None = None) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(
                self.limits.header_timeout if delay is None else delay, self._head_timed_out
            )

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        began = self._head_began
        if began is None or self._head is None or self.transport.is_closing():
            return  # no head awaited: the next one arms the timer again
        left = began + self.limits.header_timeout - time.monotonic()
        if left > 0:  # a later head than the one this timer was armed for
            self._arm_head_timer(left)
            return
        self.transport.write(
            _answer(
                408,
                "Request Timeout",
                f"the request head was not complete within {self.limits.header_timeout:g}s "
                "(KTLITE_HEADER_TIMEOUT)",
            )
        )
        self._close()


def guarded(limits: Limits) -> type[GuardedHttpTools]:
    """A protocol class for one server with these limits (given to ``uvicorn.Config(http=...)``)."""
    return type(
        "PodHttpProtocol", (GuardedHttpTools,), {"limits": limits, "cap": limits.connection_cap()}
    )
