"""One dashboard run: its secret, its server on 127.0.0.1 (uvicorn in a thread) and the
address to open."""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from ktlite.dashboard.access import Access, new_token
from ktlite.dashboard.app import create_app
from ktlite.dashboard.views import Backends
from ktlite.errors import ConfigError, KtliteError

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"  # loopback only: the dashboard can tear deployments down
START_S = 30.0  # a healthy server starts in well under a second


class Dashboard:
    """``ktlite dashboard``'s server. ``port`` 0 picks a free one; ``backends`` names those
    shown (default: every backend). ``url`` is the address with the secret."""

    def __init__(
        self, port: int = 0, backends: list[str] | None = None, namespace: str | None = None
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((HOST, port))
        except OSError as e:
            self._sock.close()
            raise ConfigError(
                f"the dashboard cannot listen on {HOST}:{port}: {e}; pick another --port "
                "(0 picks a free one)"
            ) from e
        self.port = self._sock.getsockname()[1]
        self.token = new_token()
        self.backends = Backends(backends, namespace)
        app = create_app(Access(self.token, self.port), self.backends)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/#token={self.token}"

    @property
    def base_url(self) -> str:
        """The address without the secret."""
        return f"http://{HOST}:{self.port}"

    def start(self) -> Dashboard:
        """Serve in a thread; returns once the server accepts requests."""
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            daemon=True,
            name="ktlite-dashboard",
        )
        self._thread.start()
        deadline = time.monotonic() + START_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise KtliteError(
                    f"the dashboard's server on {self.base_url} stopped as it started"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise KtliteError(
                    f"the dashboard's server on {self.base_url} did not start within {START_S:g}s"
                )
            time.sleep(0.01)  # polling uvicorn's started flag, bounded by the deadline
        logger.info("dashboard serving on %s", self.base_url)
        return self

    def wait(self) -> None:
        """Until the server stops (Ctrl-C raises KeyboardInterrupt here)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(START_S)
        self._sock.close()
        self.backends.close()

    def __enter__(self) -> Dashboard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
