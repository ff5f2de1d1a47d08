"""The dashboard's web app: the page and its JSON API.

``GET /`` and ``GET /static/...`` serve the page (files of this package; they hold no data).
Every ``/api/`` request needs the run's secret (:mod:`ktlite.dashboard.access`):

- ``GET /api/deployments``: every shown backend's deployments, or why a backend is not listed;
- ``GET /api/deployments/{backend}/{name}[?stuck_after=S]``: its pods and ranks (state, CPU,
  RSS, GPUs, running calls, stuck), its recent calls with each rank's span and a failed
  rank's traceback;
- ``GET /api/deployments/{backend}/{name}/logs?after=N``: its pod logs' lines after line N;
- ``POST /api/deployments/{backend}/{name}/teardown``: tears it down (the page asks first).
"""

from __future__ import annotations

import logging
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ktlite.dashboard.access import Access, Refused
from ktlite.dashboard.logs import TAIL_LINES, Followers
from ktlite.dashboard.views import Backends
from ktlite.errors import ConfigError, KtliteError, NotDeployedError

logger = logging.getLogger(__name__)

STATIC = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# the page runs only its own script and style, talks only to this server, is never framed
# (a framed teardown button could be clicked by another page) and sends no Referer
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


def _static(name: str) -> bytes:
    return (resources.files("ktlite.dashboard") / "static" / name).read_bytes()


def create_app(access: Access, backends: Backends) -> FastAPI:
    """The app for one dashboard run: ``access`` checks its secret, ``backends`` reads what
    it shows."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    followers = Followers()

    @app.exception_handler(Refused)
    async def refused(request: Request, e: Refused) -> Response:
        return JSONResponse({"detail": str(e)}, status_code=e.status, headers=PAGE_HEADERS)

    @app.exception_handler(KtliteError)
    async def failed(request: Request, e: KtliteError) -> Response:
        status = (
            404 if isinstance(e, NotDeployedError) else 400 if isinstance(e, ConfigError) else 502
        )
        return JSONResponse({"detail": str(e)}, status_code=status, headers=PAGE_HEADERS)

    def guard(request: Request) -> None:
        access.check(request.method, {k.lower(): v for k, v in request.headers.items()})

    def answer(body: Any) -> Response:
        return JSONResponse(body, headers=PAGE_HEADERS)

    @app.get("/")
    def page() -> Response:
        return Response(_static("index.html"), media_type="text/html", headers=PAGE_HEADERS)

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        if name not in STATIC:
            return Response(b"not found", status_code=404, headers=PAGE_HEADERS)
        return Response(_static(name), media_type=STATIC[name], headers=PAGE_HEADERS)

    @app.get("/api/deployments", dependencies=[Depends(guard)])
    def deployments() -> Response:
        return answer({"backends": backends.listing()})

    @app.get("/api/deployments/{backend}/{name}", dependencies=[Depends(guard)])
    def deployment(backend: str, name: str, stuck_after: float | None = None) -> Response:
        return answer(backends.detail(backend, name, stuck_after))

    @app.get("/api/deployments/{backend}/{name}/logs", dependencies=[Depends(guard)])
    def logs(backend: str, name: str, after: int = 0, follower: int = 0) -> Response:
        source = backends.backend(backend)
        chosen = followers.get(
            (backend, name),
            lambda: source.logs(name, None, follow=True, tail=TAIL_LINES),
            lambda: backends.secrets_of(backend, name),
        )
        return answer(chosen.since(after if follower == chosen.serial else 0))

    @app.post("/api/deployments/{backend}/{name}/teardown", dependencies=[Depends(guard)])
    def teardown(backend: str, name: str) -> Response:
        logger.info("dashboard: tearing down %s on %s", name, backend)
        if not backends.teardown(backend, name):
            raise NotDeployedError(f"no deployment {name!r} on backend {backend!r}")
        return answer({"torn_down": name, "backend": backend})

    return app
