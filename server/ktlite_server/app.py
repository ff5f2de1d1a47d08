"""The pod server's HTTP API (FastAPI on uvicorn): :class:`PodServer`.

Endpoints (all but ``/health`` need ``x-ktlite-token: Bearer <deployment token>``, checked
from the request head before anything else: ``admission.py``):

- ``GET /health``: liveness and protocol version; with the token also the pod, its launch id,
  the calls running, its Python, how long it has been idle (``idle_s``) and its
  ``inactivity_ttl``; never counted as activity; ``?ready=1`` answers 503 until a launch is loaded (a
  replica's readiness probe).
- ``POST /deploy``: install a code bundle on this pod's ranks (ktlite message body):
  ``launches.py``.
- ``POST /call``: run a call; ``x-ktlite-call`` header carries the plan, the body the opaque
  argument payload; answers with a frame stream (logs, heartbeats, then the result):
  ``calls.py``.
- ``POST /cancel/{call_id}``: stop a running call's ranks.
- ``POST /restart_failed``: restart this pod's dead rank processes.
- ``GET /status``: each rank's state, last exit, restarts, how long it has been busy, its running
  calls, and what it uses (pid, CPU %, RSS, GPU memory and utilisation: ``usage.py``).
  Both with ``x-ktlite-tree``: for every pod, gathered down the tree (``podtable.py``).
- ``GET /metrics``: Prometheus metrics (calls, outcomes, durations, bytes, each rank's
  restarts and use): ``metrics.py``. Neither it nor ``/status`` counts as activity.
- ``/ports/{port}/{path}`` (any method): HTTP to a port inside this pod, such as a
  ``kt.app(port=...)`` command's server: ``portproxy.py``.

What a connection may send and hold (head size, header and idle timeouts, the connection
cap) is enforced below the app, in ``connections.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ktlite_server import podtable
from ktlite_server.admission import Gate, Token
from ktlite_server.callerrun import LinkRuns
from ktlite_server.calls import Calls, FastCall
from ktlite_server.connections import Limits
from ktlite_server.inactivity import idle_seconds
from ktlite_server.launches import Launches
from ktlite_server.linkserver import Links
from ktlite_server.metrics import render
from ktlite_server.peers import PeerPool
from ktlite_server.pod import DEFAULT_STUCK_AFTER_S, Pod
from ktlite_server.portproxy import PortProxy
from ktlite_server.refusal import refuse
from ktlite_wire import calltree, linkframes
from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import TOKEN_HEADER, TREE_HEADER, VERSION_HEADER, bearer
from ktlite_wire.status import Status
from ktlite_wire.version import PROTOCOL_VERSION, RELEASE

_YES = ("1", "true", "yes")


def process_start() -> float:
    """When this server's process started (epoch seconds): in a container, when the
    container started. Benchmarks measure cold starts from it."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # since boot, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


@dataclasses.dataclass(eq=False)
class PodServer:
    """One pod's server: its routes over the pod's ranks, the calls it runs, its launches.

    ``asgi`` is what uvicorn serves: the admission gate (token, version, declared size) in
    front of the FastAPI app, whose ``POST /call`` skips the router (``calls.FastCall``).
    """

    pod: Pod
    token: Token
    limits: Limits
    calls: Calls
    launches: Launches
    started: float  # when this server's process started (epoch seconds)
    app: FastAPI = dataclasses.field(init=False)
    asgi: Gate = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.app = FastAPI(
            title="ktlite pod server",
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            lifespan=self._lifespan,
        )
        self.app.add_api_route("/health", self.health, methods=["GET"])
        self.app.add_api_route("/metrics", self.metrics, methods=["GET"])
        self.app.add_api_route("/status", self.status, methods=["GET"])
        self.app.add_api_route("/deploy", self.launches.deploy, methods=["POST"])
        self.app.add_api_route("/call", self.calls.call, methods=["POST"])
        self.app.add_api_route("/restart_failed", self.restart_failed, methods=["POST"])
        self.app.add_api_route("/cancel/{call_id}", self.cancel, methods=["POST"])
        self.ports = PortProxy(self.pod.name)
        self.app.add_api_route(
            "/ports/{port}/{path:path}",
            self.ports.forward,
            methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
        )
        self.asgi = Gate(
            # another pod's link (linkserver) carries its calls to this one without HTTP
            Links(
                FastCall(self.app, self.calls.call),
                self.calls.call,
                self.limits.max_body,
                self.limits.idle_timeout,
                LinkRuns(self.pod, self.limits.max_body).start,  # members' and the caller's RUNs
                self._stop,
            ),
            self.token,
            self.limits,
            on_admit=self._touch,
            pod_name=self.pod.name,
        )

    @classmethod
    def create(
        cls,
        pod: Pod,
        token: str,
        limits: Limits | None = None,
        peer_tls: ssl.SSLContext | None = None,
    ) -> PodServer:
        limits = limits or Limits()
        # every request this pod makes to another carries the deployment's token (over TLS
        # pinned to the deployment's certificate, to https:// peers)
        pod.peers = PeerPool(
            {
                TOKEN_HEADER: bearer(token),
                VERSION_HEADER: str(PROTOCOL_VERSION),
            },
            tls=peer_tls,
        )
        started = process_start()
        return cls(
            pod,
            Token(token),
            limits,
            calls=Calls(pod, token, limits.max_body, started),
            launches=Launches(pod, limits.max_body),
            started=started,
        )

    def _touch(self) -> None:
        self.pod.last_active = time.monotonic()  # a client (or a peer pod) still uses this pod

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.pod.prespawn()
        launch_file = os.environ.get("KTLITE_LAUNCH_FILE")
        if launch_file:
            self.launches.start_boot(launch_file)
        yield
        self.calls.streams.close()
        await self.ports.aclose()
        await self.pod.shutdown()
        await self.pod.peers.aclose()

    async def health(self, request: Request) -> Response:
        """Liveness; with ``?ready=1``, readiness: 503 until a launch is loaded (an autoscaled
        replica must not take calls before it has the code). ``calls`` is the number running.
        Without the token it tells only that (liveness, readiness) and the protocol version."""
        pod = self.pod
        body: dict[str, Any] = {"status": "ok", "protocol": PROTOCOL_VERSION}
        authed = self.token.in_scope(request.scope)
        if authed:
            body.update(
                version=RELEASE,
                python=platform.python_version(),
                pod=pod.name,
                ordinal=pod.ordinal,
                launch_id=pod.dep.launch_id if pod.dep else None,
                generation=self.launches.generation,  # of a served deployment's launches
                started=self.started,
                engine_failed=pod.engine_failed,
                calls=len(pod.calls),
                # how long without a call, and the TTL: what `ktlite list` shows and sweeps by
                idle_s=round(idle_seconds(pod), 3),
                inactivity_ttl=pod.inactivity_ttl,
            )
        if request.query_params.get("ready") and (
            pod.dep is None or pod.ready_launch != pod.dep.launch_id
        ):
            body["status"] = "not ready"
            if authed:
                body["detail"] = self.launches.boot or (
                    "no launch loaded yet"
                    if pod.dep is None
                    else f"launch {pod.dep.launch_id} is loading or failed"
                )
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    async def metrics(self) -> Response:
        """Prometheus metrics (``metrics.py``): calls, their outcomes and durations, bytes,
        and each rank's restarts and use. Scrapes send the deployment token, as every other
        caller does."""
        ranks = (await self.pod.status()).get("ranks") or []
        try:
            body, content_type = render(
                self.pod.call_metrics, self.pod.calls_total, len(self.pod.calls), ranks
            )
        except ImportError:
            raise refuse(
                503,
                ErrorCode.INTERNAL,
                f"pod {self.pod.name} has no prometheus_client, which /metrics needs: use an "
                "image with ktlite's server packages, or one the client may ship them to",
            ) from None
        return Response(body, media_type=content_type)

    async def status(self, request: Request) -> Any:
        try:
            stuck_after = float(request.query_params.get("stuck_after", DEFAULT_STUCK_AFTER_S))
        except ValueError:
            raise refuse(
                400, ErrorCode.BAD_REQUEST, "stuck_after must be a number of seconds"
            ) from None
        relay = self._relay(request)  # the whole subtree's, in one answer: podtable.py
        if relay is not None:
            own = self.pod.status(stuck_after)
            return await podtable.statuses(self.pod.peers, relay, own, dict(request.query_params))
        return await self.pod.status(stuck_after)

    def _relay(self, request: Request) -> calltree.LaunchRelay | None:
        try:
            return podtable.parse(request.headers.get(TREE_HEADER), self.pod.ordinal)
        except ValueError as e:
            raise refuse(400, ErrorCode.BAD_REQUEST, f"malformed x-ktlite-tree: {e}") from e

    async def restart_failed(self, request: Request) -> Any:
        """Restart this pod's dead rank processes (only those: the others keep their state)."""
        relay = self._relay(request)
        if relay is not None:
            return await podtable.restarts(self.pod.peers, relay, self._restart)
        regroup = request.query_params.get("regroup", "").lower() in _YES
        return JSONResponse(await self._restart(regroup))

    async def _restart(self, regroup: bool) -> dict[str, Any]:
        pod = self.pod
        if pod.dep is None:
            raise refuse(
                409,
                ErrorCode.NOT_DEPLOYED,
                f"pod {pod.name} has no code deployed; call .to() first",
            )
        result = await pod.restart_failed()
        if result["restarted"] or regroup:
            pod.next_generation()  # on pod 0 this re-forms the process group at the next call
        return {**result, "pod": pod.name, "ordinal": pod.ordinal, "generation": pod.generation}

    async def cancel(self, call_id: str, request: Request) -> JSONResponse:
        query = request.query_params
        reason = query.get("reason", "cancelled by the caller")
        reset = query.get("reset", "false").lower() in _YES
        kind = _STOPS.get(query.get("kind", "cancelled"))
        if kind is None:
            raise refuse(
                400,
                ErrorCode.BAD_REQUEST,
                f"kind={query.get('kind')!r}; allowed: cancelled, timeout",
            )
        return JSONResponse({"cancelled": self.calls.cancel(call_id, kind, reason[:500], reset)})

    def _stop(self, stop: linkframes.Stop) -> None:
        """A ``STOP`` on a link: what ``POST /cancel`` does (its coordinator sends it)."""
        self.calls.cancel(stop.call_id, stop.kind, stop.reason, stop.reset)


_STOPS = {s.value: s for s in (Status.CANCELLED, Status.TIMEOUT)}


def create_app(
    pod: Pod,
    token: str,
    *,
    max_body: int | None = None,
    limits: Limits | None = None,
    peer_tls: ssl.SSLContext | None = None,
) -> Gate:
    """The ASGI app of a pod server for ``pod`` (``PodServer.create(...).asgi``); ``peer_tls``
    pins the deployment's certificate for ``https://`` peers."""
    limits = limits or Limits()
    if max_body is not None:
        limits = dataclasses.replace(limits, max_body=max_body)
    return PodServer.create(pod, token, limits, peer_tls).asgi
