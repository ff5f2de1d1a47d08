"""HTTP client for a deployment's pods (httpx, injectable transport).

Translates transport failures into ktlite errors where they enter: connection errors
become :class:`PodUnreachable`, 401 :class:`AuthError`, a version clash
:class:`ProtocolMismatch`. Holds the token privately; it never appears in a repr.
"""

from __future__ import annotations

import atexit
import contextlib
import json
from collections.abc import Callable
from typing import Any

import httpx

from ktlite import protocol
from ktlite.connection import ConnectionFailed, Pool
from ktlite.errors import AuthError, KtliteError, NotDeployedError, PodUnreachable, ProtocolMismatch

# The server sends a heartbeat frame every 2 s; silence this long means the pod is gone.
SILENCE_TIMEOUT = 10.0
LogSink = Callable[[int, str, str, str], None]  # (rank, pod, stream, text)
Outcomes = list[tuple[int, str, str, Any, str, float]]  # (rank, pod, status, data, message, at)


_shared: httpx.Client | None = None
_pool = Pool()
atexit.register(_pool.close)


def _shared_http() -> httpx.Client:
    """One keep-alive pool for every deployment of this process (tokens go per request)."""
    global _shared
    if _shared is None:
        _shared = httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0),
                               limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))
        atexit.register(_shared.close)
    return _shared


class PodClient:
    def __init__(self, token: str, http: httpx.Client | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._token = token
        self._owns = transport is not None
        # calls to plain http:// pods take the lean connection unless a client was injected
        self._lean = http is None and transport is None
        if transport is not None:
            http = httpx.Client(transport=transport, timeout=httpx.Timeout(30.0, connect=10.0))
        self.http = http or _shared_http()

    def __repr__(self) -> str:
        return "PodClient(token=<hidden>)"

    def close(self) -> None:
        if self._owns:
            self.http.close()

    def forget(self, url: str) -> None:
        """Drop pooled connections to a pod that is gone (after a teardown), in the call pool
        and in httpx's (whose idle sockets would otherwise wait for their next use)."""
        _pool.drop(url)
        with contextlib.suppress(Exception):  # httpx keeps its pool private: best effort
            import httpcore
            u = httpx.URL(url)
            origin = httpcore.Origin(u.scheme.encode(), u.host.encode(), u.port or 80)
            for conn in list(self.http._transport._pool.connections):
                if conn.is_idle() and conn.can_handle_request(origin):
                    conn.close()

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {protocol.TOKEN_HEADER: protocol.bearer(self._token),
             protocol.VERSION_HEADER: str(protocol.PROTOCOL_VERSION)}
        if extra:
            h.update(extra)
        return h

    @staticmethod
    def _check(resp: httpx.Response, url: str) -> None:
        if resp.status_code < 400:
            return
        try:
            resp.read()
            detail = resp.json().get("detail", resp.text)
        except (ValueError, AttributeError, httpx.HTTPError):
            detail = resp.text if resp.is_stream_consumed else ""
        _raise_for_status(resp.status_code, str(detail), url)

    def health(self, url: str, timeout: float = 2.0) -> dict[str, Any]:
        try:
            resp = self.http.get(f"{url}/health", timeout=timeout)
        except httpx.HTTPError as e:
            raise PodUnreachable(f"pod at {url} is not answering /health: {e!r}") from e
        if resp.status_code in (502, 503, 504):  # a proxy (the API server's) cannot reach it yet
            raise PodUnreachable(f"pod at {url} is not reachable through the proxy yet "
                                 f"(HTTP {resp.status_code}): {resp.text[:300]}")
        self._check(resp, url)
        data: dict[str, Any] = resp.json()
        if data.get("protocol") != protocol.PROTOCOL_VERSION:
            raise ProtocolMismatch(f"pod at {url} runs ktlite {data.get('version')} speaking protocol "
                                   f"{data.get('protocol')}; this client speaks {protocol.PROTOCOL_VERSION}")
        return data

    def deploy(self, url: str, message: bytes, timeout: float) -> Outcomes:
        try:
            resp = self.http.post(f"{url}/deploy", content=message, headers=self._headers(),
                                  timeout=httpx.Timeout(timeout, connect=10.0))
        except httpx.HTTPError as e:
            raise PodUnreachable(f"could not deploy to pod at {url}: {e!r}") from e
        self._check(resp, url)
        return list(protocol.loads(bytearray(resp.content))["outcomes"])

    def status(self, url: str, stuck_after: float | None = None) -> dict[str, Any]:
        params = {} if stuck_after is None else {"stuck_after": str(stuck_after)}
        try:
            resp = self.http.get(f"{url}/status", headers=self._headers(), params=params, timeout=5.0)
        except httpx.HTTPError as e:
            raise PodUnreachable(f"pod at {url} is not answering /status: {e!r}") from e
        self._check(resp, url)
        result: dict[str, Any] = resp.json()
        return result

    def cancel(self, url: str, call_id: str, reason: str = "cancelled by the caller",
               timeout: float = 5.0) -> None:
        # best effort: the pod also cancels when our stream closes
        with contextlib.suppress(httpx.HTTPError):
            self.http.post(f"{url}/cancel/{call_id}", params={"reason": reason},
                           headers=self._headers(), timeout=timeout)

    def call(self, url: str, meta: dict[str, Any], parts: list[Any], on_log: LogSink | None) -> Outcomes:
        """Run a call through the coordinator at ``url``; returns per-rank outcomes."""
        headers = self._headers({protocol.CALL_HEADER: json.dumps(meta),
                                 "content-type": "application/octet-stream"})
        try:
            if self._lean and url.startswith("http://"):
                return self._call_lean(url, headers, parts, on_log)
            return self._call_httpx(url, headers, parts, on_log)
        except (httpx.ReadTimeout, TimeoutError) as e:
            raise PodUnreachable(f"the coordinator pod at {url} went silent for {SILENCE_TIMEOUT:g}s "
                                 "during the call (no heartbeat): it probably died") from e
        except (httpx.HTTPError, ConnectionFailed, OSError) as e:
            raise PodUnreachable(f"lost the connection to the coordinator pod at {url}: {e!r}") from e
        except protocol.ProtocolError as e:
            raise PodUnreachable(f"the coordinator pod at {url} closed the stream mid-call: {e}") from e

    def _call_lean(self, url: str, headers: dict[str, str], parts: list[Any],
                   on_log: LogSink | None) -> Outcomes:
        conn, status, hdrs = _pool.post(url, "/call", headers, parts, connect_timeout=10.0,
                                        read_timeout=SILENCE_TIMEOUT)
        try:
            if status >= 400:
                body = b"".join(conn.body(hdrs))
                try:
                    detail = str(json.loads(body).get("detail", body))
                except ValueError:
                    detail = body.decode(errors="replace")
                _raise_for_status(status, detail, url)
            result = _read_result(conn.body(hdrs), on_log, url)
        except BaseException:
            conn.close()
            raise
        _pool.release(conn)
        return result

    def _call_httpx(self, url: str, headers: dict[str, str], parts: list[Any],
                    on_log: LogSink | None) -> Outcomes:
        headers["content-length"] = str(protocol.parts_size(parts))
        timeout = httpx.Timeout(connect=10.0, read=SILENCE_TIMEOUT, write=300.0, pool=30.0)
        with self.http.stream("POST", f"{url}/call", content=protocol.chunked(parts),
                              headers=headers, timeout=timeout) as resp:
            self._check(resp, url)
            return _read_result(resp.iter_raw(), on_log, url)


def _read_result(chunks: Any, on_log: LogSink | None, url: str) -> Outcomes:
    """Print log frames as they come; return the result frame's outcomes. Reads the stream
    to its end (it ends right after the result) so the connection can be reused."""
    result = None
    for kind, payload in protocol.read_frames(chunks):
        if kind == protocol.LOG:
            if on_log is not None:
                on_log(*json.loads(payload))
        elif kind == protocol.RESULT:
            result = list(protocol.loads(payload)["outcomes"])
        elif kind == protocol.ERROR:
            err = json.loads(payload)
            raise KtliteError(f"pod at {url} failed the call: {err['type']}: {err['message']}")
    if result is None:
        raise PodUnreachable(f"the coordinator pod at {url} ended the call without a result")
    return result


def _raise_for_status(status: int, detail: str, url: str) -> None:
    if status < 400:
        return
    if status == 401:
        raise AuthError(f"pod at {url} refused the deployment token (HTTP 401): {detail}; "
                        "the deployment was probably re-created: call .to() again")
    if status == 409 and "protocol version" in detail:
        raise ProtocolMismatch(detail)
    if status == 409:
        raise NotDeployedError(detail)
    raise KtliteError(f"pod at {url} answered HTTP {status}: {detail}")
