"""An ASGI app served by a real uvicorn in a thread, with the pod server's own connection
handling (``connections.guarded``) unless told otherwise, plain or TLS with the certificate a
token makes (the tests of the call response and of bulk bodies)."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from ktlite.net import tls
from ktlite_server.connections import Limits, guarded

WAIT_S = 30.0  # the server's start and stop; a healthy one takes milliseconds


class Served:
    """``app`` on uvicorn; ``protocol`` is uvicorn's ``http`` setting (default: the pod
    server's); TLS with ``token``'s certificate when ``tls_dir`` is given. ``url``, ``port``,
    and ``context`` (a client context pinned to that certificate, or None)."""

    def __init__(self, app: Any, tls_dir: Path | None, token: str, protocol: Any = None) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(
            app,
            loop="uvloop",
            http=protocol or guarded(Limits()),
            log_level="warning",
            lifespan="off",
        )
        scheme = "http"
        if tls_dir is not None:
            ident = tls.identity(token)
            (tls_dir / "cert.pem").write_bytes(ident.cert_pem)
            (tls_dir / "key.pem").write_bytes(ident.key_pem)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls_dir / "cert.pem", tls_dir / "key.pem")
            config.load()
            config.ssl = context
            scheme = "https"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the test's uvicorn server did not start within {WAIT_S:g} s")
            time.sleep(0.01)  # polling the started flag, bounded by the deadline
        self.port = sock.getsockname()[1]
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.context = tls.pinned_context(token) if tls_dir is not None else None

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
