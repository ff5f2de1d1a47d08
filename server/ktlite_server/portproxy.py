"""``/ports/{port}/{path}``: HTTP to a port inside this pod, behind the deployment token.

What a pod's own command serves (``kt.app(port=8000)``'s FastAPI app, TensorBoard started by
a training function, a notebook server) listens inside the pod, where the caller cannot reach
it: on Kubernetes the caller has only the API server's pod proxy, and the deployment's
NetworkPolicy opens no port but the pod server's to anything outside the deployment. The
pod server forwards such a request to ``127.0.0.1:{port}`` in its pod, so a token holder
(who can run any code here anyway) reaches it the way it reaches the pod server; ``ktlite
port-forward`` and ``App.local_port()`` put a plain local URL in front of it.

Bodies stream both ways (nothing is held whole); hop-by-hop headers and the deployment token
are not passed on. A port nothing listens on is a 502 naming it; an app silent for
``READ_TIMEOUT_S`` a 504. WebSocket upgrades are not forwarded.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import ERROR_CODE_HEADER, HOP_BY_HOP, TOKEN_HEADER, VERSION_HEADER

logger = logging.getLogger(__name__)

PREFIX = "/ports/"
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 300.0  # an app's answer (or the next piece of a streamed one) within this
_DROP = HOP_BY_HOP | {TOKEN_HEADER, VERSION_HEADER}  # and the token: never the app's
_OWN = frozenset({"date", "server"})  # this server's own answer carries them already


class PortProxy:
    """Forwards requests to ports of this pod's loopback interface (one client, made when
    first needed: a pod that serves no app never imports httpx)."""

    def __init__(self, pod_name: str) -> None:
        self.pod_name = pod_name
        self._client: Any = None

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(
                    connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S, write=READ_TIMEOUT_S, pool=30.0
                ),
                follow_redirects=False,
                trust_env=False,  # the pod's own loopback: never through an HTTP proxy
            )
        return self._client

    async def forward(self, port: str, path: str, request: Request) -> Response:
        import httpx

        if not port.isdigit() or not 1 <= int(port) <= 65535:
            return _error(400, f"{port!r} is not a port number (1-65535)", ErrorCode.BAD_REQUEST)
        url = f"http://127.0.0.1:{int(port)}/{path}"
        if request.url.query:
            url += "?" + request.url.query
        headers = [
            (k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _DROP
        ]
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        if "content-length" in request.headers and "transfer-encoding" not in request.headers:
            # streamed on with its length: an app may read a body only by its length
            headers.append((b"content-length", request.headers["content-length"].encode()))
        client = self._http()
        outgoing = client.build_request(
            request.method,
            url,
            headers=headers,
            content=_body(request) if has_body else None,
        )
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.ConnectError:
            return _error(
                502,
                f"nothing listens on port {port} in pod {self.pod_name} (the command that "
                "serves it has not started yet, or has exited: `ktlite logs` shows its output)",
                ErrorCode.PORT_UNREACHABLE,
            )
        except httpx.TimeoutException:
            return _error(
                504,
                f"port {port} in pod {self.pod_name} accepted the request but did not answer "
                f"within {READ_TIMEOUT_S:g}s",
                ErrorCode.PORT_UNREACHABLE,
            )
        except httpx.HTTPError as e:
            return _error(
                502, f"port {port} in pod {self.pod_name}: {e!r}", ErrorCode.PORT_UNREACHABLE
            )
        passed = {k: v for k, v in answer.headers.items() if k.lower() not in _DROP | _OWN}
        if "content-length" in answer.headers and "transfer-encoding" not in answer.headers:
            passed["content-length"] = answer.headers["content-length"]  # raw bytes: unchanged
        return StreamingResponse(
            answer.aiter_raw(),
            status_code=answer.status_code,
            headers=passed,
            background=BackgroundTask(answer.aclose),
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def _body(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


def _error(status: int, detail: str, code: ErrorCode) -> JSONResponse:
    return JSONResponse(
        {"detail": detail}, status_code=status, headers={ERROR_CODE_HEADER: code.value}
    )
