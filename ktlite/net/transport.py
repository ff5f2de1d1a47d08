"""How the client reaches a pod: one request path for every endpoint, and the one place
where foreign errors (httpx's, ``OSError``, socket timeouts) become ktlite errors.

A pod reached directly (the local and SSH backends, in-cluster callers; plain ``http://``, or
``https://`` pinned to the deployment's certificate) is spoken to through
:mod:`ktlite.net.connection`'s keep-alive pool, the same lean connections calls take; a pod
behind a proxy that needs TLS and the user's credentials (the Kubernetes
API server's pod proxy) through the injected ``httpx`` client. Either way a request returns
a :class:`Reply`; a pod that cannot be reached is a :class:`~ktlite.errors.PodUnreachable`.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx

from ktlite.errors import PodUnreachable
from ktlite.logconfig import http_hook
from ktlite.net.connection import ConnectionFailed, ConnectionRefused, Pool

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


class PodSilent(PodUnreachable):
    """The pod accepted the request but sent nothing back in time."""


@dataclass
class Reply:
    """A pod's whole answer."""

    status: int
    headers: Mapping[str, str]  # lower-case names
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class PodTransport:
    """Requests to pods; ``http`` is an injected client (a proxy's), None for direct pods;
    ``pinned`` gives the TLS context of the deployment's ``https://`` pods (made when first
    needed)."""

    def __init__(
        self,
        pool: Pool,
        http: httpx.Client | None,
        log: logging.Logger = logger,
        pinned: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self.pool = pool
        self.http = http
        self.log = log  # each request to a direct pod: one DEBUG record (no header, no query)
        self.pinned = pinned

    def direct(self, url: str) -> bool:
        if self.http is not None:
            return False
        return url.startswith("http://") or (self.pinned is not None and url.startswith("https://"))

    def context(self, url: str) -> ssl.SSLContext | None:
        """The TLS context for a direct pod at ``url``: None for ``http://``."""
        if url.startswith("https://") and self.pinned is not None:
            return self.pinned()
        return None

    def request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        what: str,
        timeout: float,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        content: Any = b"",
        length: int | None = None,
    ) -> Reply:
        """One request; ``what`` names it in errors ("/health", "the deploy"). ``content`` is
        bytes, or (through httpx only) an iterator sent chunked with ``length`` announced."""
        query = f"?{urlencode(params)}" if params else ""
        try:
            if self.direct(url):
                parts = (
                    [content]
                    if isinstance(content, (bytes, bytearray, memoryview))
                    else list(content)
                )
                status, hdrs, body = self.pool.fetch(
                    method,
                    url,
                    path + query,
                    dict(headers or {}),
                    parts,
                    CONNECT_TIMEOUT_S,
                    timeout,
                    self.context(url),
                )
                self.log.debug("%s %s%s -> %d (direct connection)", method, url, path, status)
                return Reply(status, hdrs, body)
            http = self.http or shared_http()
            resp = http.request(
                method,
                f"{url}{path}",
                params=params,
                headers=headers,
                content=content,
                timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
            )
            return Reply(
                resp.status_code, {k.lower(): v for k, v in resp.headers.items()}, resp.content
            )
        except (httpx.ReadTimeout, httpx.PoolTimeout, TimeoutError) as e:
            raise PodSilent(f"pod at {url} did not answer {what} within {timeout:g}s: {e!r}") from e
        except ConnectionRefused as e:
            raise PodUnreachable(
                f"pod at {url} is not answering {what}: {e}", delivered=False
            ) from e
        except (httpx.HTTPError, ConnectionFailed, OSError) as e:
            raise PodUnreachable(f"pod at {url} is not answering {what}: {e!r}") from e


_shared: httpx.Client | None = None


def shared_http() -> httpx.Client:
    """A client for requests that go neither to a direct pod (``http://``, or ``https://``
    with a pinned context) nor through an injected client: one keep-alive pool for the
    process."""
    global _shared
    if _shared is None:
        import atexit

        _shared = httpx.Client(
            timeout=httpx.Timeout(30.0, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
            event_hooks={"response": [http_hook(logging.getLogger("ktlite.net.client"))]},
        )
        atexit.register(_shared.close)
    return _shared
