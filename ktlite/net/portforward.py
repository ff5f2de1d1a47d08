"""A local URL for a port inside a pod: ``ktlite port-forward``, ``App.local_port()``.

:class:`PortForward` listens on this machine's loopback interface and passes each HTTP request
to the pod server's ``/ports/{port}/...`` (:mod:`ktlite_server.portproxy`) with the deployment
token, the way every other request reaches the pod: directly (local and SSH backends, TLS
pinned to the deployment's certificate where on) or through the Kubernetes API server's pod
proxy with the user's credentials. A browser, ``curl`` or a client library then uses
``http://127.0.0.1:LOCAL/...`` as if the app ran here. Bodies stream both ways; plain HTTP
only (no WebSocket upgrade).
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ktlite_wire import pinning
from ktlite_wire.headers import HOP_BY_HOP, TOKEN_HEADER, bearer

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 330.0  # past the pod side's 300 s, so the pod's 504 (which says why) comes first
# a local client's connection that sends nothing for this long (idle between requests, or
# stalled mid-request) is closed, so no forwarding thread waits on it forever
IDLE_TIMEOUT_S = 120.0


class PortForward:
    """Forwards ``http://host:local_port/...`` to ``port`` in the pod whose server is at
    ``pod_url``; :meth:`start` binds and serves from a thread, :meth:`close` stops."""

    def __init__(
        self,
        pod_url: str,
        port: int,
        token: str,
        *,
        http: httpx.Client | None = None,
        pinned: Callable[[], ssl.SSLContext] | None = None,
        local_port: int = 0,
        host: str = "127.0.0.1",
        idle_timeout: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.target = f"{pod_url.rstrip('/')}/ports/{port}"
        self.port = port
        self._token = token
        self._own_client = http is None
        self._extensions: dict[str, Any] = {}
        if http is None:
            verify: Any = True
            if pinned is not None and pod_url.startswith("https"):
                # a direct pod's certificate is the deployment's, named for no address
                verify = pinned()
                self._extensions["sni_hostname"] = pinning.SERVER_NAME
            http = httpx.Client(verify=verify, trust_env=False)
        self.http = http
        self.idle_timeout = idle_timeout
        self._server = _Server((host, local_port), _handler(self))
        self.local_port: int = self._server.server_address[1]
        self.url = f"http://{host}:{self.local_port}"
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<PortForward {self.url} -> {self.target}>"

    def start(self) -> int:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"ktlite-port-forward-{self.local_port}",
            daemon=True,
        )
        self._thread.start()
        return self.local_port

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5.0)
            self._thread = None
        self._server.server_close()
        if self._own_client:
            self.http.close()

    def open(self, method: str, path: str, headers: list[tuple[str, str]], body: Any) -> Any:
        """The pod's answer to one request, streaming (a context manager)."""
        sent = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
        sent.append((TOKEN_HEADER, bearer(self._token)))
        return self.http.stream(
            method,
            self.target + path,
            headers=sent,
            content=body,
            timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S),
            extensions=self._extensions,
        )


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().server_bind()


def _handler(forward: PortForward) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: every answer has a length or is chunked
        timeout = forward.idle_timeout  # on the local client's socket: reads that wait give up

        def _relay(self) -> None:
            path = self.path if self.path.startswith("/") else "/" + self.path
            try:
                with forward.open(
                    self.command, path, list(self.headers.items()), self._body()
                ) as r:
                    self.send_response_only(r.status_code)
                    for k, v in r.headers.multi_items():
                        if k.lower() not in HOP_BY_HOP:
                            self.send_header(k, v)
                    length = r.headers.get("content-length")
                    chunked = length is None and self.command != "HEAD" and r.status_code >= 200
                    if length is not None:
                        self.send_header("content-length", length)
                    elif chunked:
                        self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for piece in r.iter_raw():
                        if piece:
                            self.wfile.write(
                                b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
                            )
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
            except httpx.HTTPError as e:
                self._fail(502, f"ktlite port-forward: cannot reach {forward.target}: {e!r}")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the local client went away

        def _body(self) -> Iterator[bytes] | bytes | None:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                return _dechunk(self.rfile)
            length = int(self.headers.get("content-length") or 0)
            return self.rfile.read(length) if length else None

        def _fail(self, status: int, text: str) -> None:
            body = text.encode()
            with contextlib.suppress(OSError):
                self.send_response_only(status)
                self.send_header("content-type", "text/plain; charset=utf-8")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
            logger.debug("port-forward %s: " + format, self.address_string(), *args)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _relay

    return Handler


def _dechunk(stream: Any) -> Iterator[bytes]:
    """A chunked request body, as its pieces."""
    while True:
        size = int(stream.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while stream.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return
        yield stream.read(size)
        stream.readline()
