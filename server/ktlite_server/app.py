"""The pod server's HTTP API (FastAPI on uvicorn).

Endpoints (all but ``/health`` need ``x-ktlite-token: Bearer <deployment token>``):

- ``GET /health``: liveness, protocol version, launch id, calls running; ``?ready=1`` answers
  503 until a launch is loaded (a replica's readiness probe).
- ``POST /deploy``: install a code bundle on this pod's ranks (ktlite message body).
- ``POST /call``: run a call; ``x-ktlite-call`` header carries the plan, the body the opaque
  argument payload; answers with a frame stream (logs, heartbeats, then the result).
- ``POST /cancel/{call_id}``: stop a running call's ranks.
- ``GET /status``: each rank's state, last exit, restarts, how long it has been busy, its running
  calls, and what it uses (pid, CPU %, RSS, GPU memory and utilisation: ``usage.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gzip
import hmac
import json
import logging
import mmap
import os
import platform
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

import ktlite
from ktlite import protocol, shm
from ktlite.spec import DistributedConfig, distributed_env
from ktlite_server.coordinator import CallPlan, Coordinator, run_local
from ktlite_server.peers import PeerPool
from ktlite_server.pod import DEFAULT_STUCK_AFTER_S, LOG_BODIES, Colocated, Deployment, Pod
from ktlite_server.streams import RETAIN_S, CallStream, Streams

logger = logging.getLogger(__name__)
DEFAULT_MAX_BODY = 8 << 30


class StreamResponse(Response):
    """Carries a call's frames (from frame ``start`` on) to one HTTP response."""

    media_type = "application/x-ktlite-frames"

    def __init__(self, stream: CallStream, start: int) -> None:
        super().__init__(status_code=200, media_type=self.media_type)
        self.stream = stream
        self.start = start

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.stream.send(send, receive, self.start)


async def _read_body(request: Request, limit: int) -> tuple[Any, str | None]:
    """Read the body into memory, or straight into a shared-memory file when large."""
    # a chunked body (through a proxy) names its length in LENGTH_HEADER
    length = request.headers.get("content-length") or request.headers.get(protocol.LENGTH_HEADER)
    if length is None or not length.isdigit():
        raise HTTPException(411, f"a Content-Length (or {protocol.LENGTH_HEADER}) header is required")
    n = int(length)
    if n > limit:
        raise HTTPException(413, f"body of {n} bytes is larger than this server's limit of {limit} bytes "
                                 "(KTLITE_MAX_BODY)")
    path = None
    if n > shm.INLINE_MAX:
        fd, path = tempfile.mkstemp(prefix=shm.ARG_PREFIX, dir=shm.shm_dir())
        os.ftruncate(fd, n)
        buf: Any = mmap.mmap(fd, n)
        os.close(fd)
    else:
        buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    try:
        async for chunk in request.stream():
            k = len(chunk)
            if got + k > n:
                raise HTTPException(400, f"body is longer than its Content-Length of {n} bytes")
            view[got:got + k] = chunk
            got += k
    except (ClientDisconnect, HTTPException):
        if path:
            os.unlink(path)
        raise
    if got != n:
        if path:
            os.unlink(path)
        raise HTTPException(400, f"body truncated: got {got} of {n} bytes")
    return view, path


def _process_start() -> float:
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


def _resume_from(request: Request) -> int | None:
    """The first frame a re-attaching caller lacks (None: a new call)."""
    value = request.headers.get(protocol.RESUME_HEADER)
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"{protocol.RESUME_HEADER} must be a frame number, got {value[:40]!r}")
    return int(value)


async def _discard_body(request: Request) -> None:
    """Read a body this request does not need (a re-sent call), so the connection stays usable."""
    with contextlib.suppress(ClientDisconnect):
        async for _ in request.stream():
            pass


class FastCall:
    """The FastAPI app, with ``POST /call`` handed straight to its route handler.

    A warm call spends as long in the middleware stack and router as in everything else
    on the server; the handler, its auth check and its errors are the same either way.
    """

    def __init__(self, app: FastAPI, call: Callable[[Request], Awaitable[Response]]) -> None:
        self.app = app
        self._call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/call":
            try:
                response = await self._call(Request(scope, receive))
            except HTTPException as e:
                response = JSONResponse({"detail": e.detail}, status_code=e.status_code, headers=e.headers)
            except ClientDisconnect:
                return  # the caller left mid-upload: nothing to answer, nothing ran
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(pod: Pod, token: str, *, max_body: int = DEFAULT_MAX_BODY,
               client: httpx.AsyncClient | None = None) -> FastCall:
    """Build the pod server app; ``client`` is the HTTP client used to reach peer pods."""
    expected = protocol.bearer(token).encode()
    started = _process_start()
    state: dict[str, Any] = {"client": client, "peers": PeerPool(), "streams": Streams(),
                             "deploys": collections.OrderedDict(), "coordinators": {}}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        if state["client"] is None:
            state["client"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=30.0)
        await pod.prespawn()
        launch_file = os.environ.get("KTLITE_LAUNCH_FILE")
        if launch_file:
            state["boot_task"] = asyncio.get_running_loop().create_task(boot_launch(launch_file))
        yield
        state["streams"].close()
        await pod.shutdown()
        await state["client"].aclose()
        await state["peers"].aclose()

    app = FastAPI(title="ktlite pod server", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    def authorize(request: Request) -> None:
        got = request.headers.get(protocol.TOKEN_HEADER, "").encode()
        if not hmac.compare_digest(got, expected):
            raise HTTPException(401, "missing or wrong deployment token")
        pod.last_active = time.monotonic()  # a client (or a peer pod) still uses this pod
        version = request.headers.get(protocol.VERSION_HEADER)
        if version is not None and version != str(protocol.PROTOCOL_VERSION):
            raise HTTPException(409, f"protocol version mismatch: client speaks {version}, server "
                                     f"(ktlite {ktlite.__version__}) speaks {protocol.PROTOCOL_VERSION}; "
                                     "install the same ktlite version on both sides")

    @app.get("/health")
    async def health(request: Request) -> Response:
        """Liveness; with ``?ready=1``, readiness: 503 until a launch is loaded (an autoscaled
        replica must not take calls before it has the code). ``calls`` is the number running."""
        body = {"status": "ok", "protocol": protocol.PROTOCOL_VERSION, "version": ktlite.__version__,
                "python": platform.python_version(), "pod": pod.name, "ordinal": pod.ordinal,
                "launch_id": pod.dep.launch_id if pod.dep else None, "started": started,
                "engine_failed": pod.engine_failed, "calls": len(pod.calls)}
        if request.query_params.get("ready") and (pod.dep is None or pod.ready_launch != pod.dep.launch_id):
            body.update(status="not ready", detail=state.get("boot") or (
                "no launch loaded yet" if pod.dep is None else f"launch {pod.dep.launch_id} is loading or failed"))
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text: the calls running now (what an HPA on ``metric="concurrency"``
        scales on, through a metrics adapter) and the calls taken since start. Scrapes send the
        deployment token, as every other caller does."""
        authorize(request)
        text = ("# HELP ktlite_inflight_calls Calls running on this pod now.\n"
                "# TYPE ktlite_inflight_calls gauge\n"
                f"ktlite_inflight_calls {len(pod.calls)}\n"
                "# HELP ktlite_calls_total Calls this pod has taken since it started.\n"
                "# TYPE ktlite_calls_total counter\n"
                f"ktlite_calls_total {pod.calls_total}\n")
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        authorize(request)
        try:
            stuck_after = float(request.query_params.get("stuck_after", DEFAULT_STUCK_AFTER_S))
        except ValueError:
            raise HTTPException(400, "stuck_after must be a number of seconds") from None
        return await pod.status(stuck_after)

    @app.post("/deploy")
    async def deploy(request: Request) -> Response:
        authorize(request)
        body, path = await _read_body(request, max_body)
        try:
            msg = protocol.loads(body)
            if msg.get("colocate"):
                name = str(msg["colocate"])
                target = None if msg.get("drop") else Colocated(
                    bundle=bytes(msg["bundle"]), kind=str(msg["kind"]), init=msg.get("init"),
                    sources=dict(msg.get("sources") or {}))
        except Exception as e:  # noqa: BLE001
            if path:
                os.unlink(path)
            raise HTTPException(400, f"malformed deploy request: {type(e).__name__}: {e}") from e
        if msg.get("colocate"):
            if path:
                os.unlink(path)
            return await _colocate(msg, name, target)
        try:
            outs = await install(msg)
        finally:
            if path:
                os.unlink(path)
        parts = protocol.gather_parts([(o.rank, pod.name, o.status, o.data, o.message, o.at) for o in outs])
        return Response(b"".join(bytes(memoryview(p)) for p in parts), media_type="application/octet-stream")

    async def install(msg: dict[str, Any]) -> list[Any]:
        """Install a launch (a POST /deploy body, or the launch file a replica boots from)."""
        if msg.get("replica"):
            # an autoscaled deployment's replica is a world of its own: rank 0 of one pod, at
            # this pod's own address (a replica started later reads the launch the client wrote)
            msg = {**msg, "ordinal": pod.ordinal,
                   "pod_ips": [os.environ.get("KTLITE_POD_IP") or msg.get("pod_ips", ["127.0.0.1"])[0]]}
        try:
            dep = Deployment(
                launch_id=msg["launch_id"], bundle=bytes(msg["bundle"]), kind=msg["kind"],
                init=msg.get("init"), sources=msg.get("sources") or {},
                config=DistributedConfig(**msg["distributed"]), pod_ips=list(msg["pod_ips"]),
                ordinal=int(msg["ordinal"]), master_port=int(msg["master_port"]),
                max_restarts=int(msg.get("max_restarts", 3)), cpus=msg.get("cpus"),
                load_timeout=float(msg.get("load_timeout", 300)),
                concurrency=max(1, int(msg.get("concurrency", 1))), engine=msg.get("engine"),
                single=bool(msg.get("single", False)))
            # the same env every rank would get: a bad layout is refused here, before it
            # replaces the deployment the pod is serving
            distributed_env(dep.config, node_rank=dep.ordinal, local_rank=0, pod_ips=dep.pod_ips,
                            master_port=dep.master_port)
            if not 0 <= dep.ordinal < dep.config.workers:
                raise ValueError(f"ordinal {dep.ordinal} is outside 0..{dep.config.workers - 1}")
        except Exception as e:  # noqa: BLE001 - any undecodable or inconsistent body is the client's fault
            raise HTTPException(400, f"malformed deploy request: {type(e).__name__}: {e}") from e
        if dep.ordinal != pod.ordinal:
            raise HTTPException(400, f"deploy for ordinal {dep.ordinal} sent to pod {pod.name} "
                                     f"(ordinal {pod.ordinal})")
        if "store" in msg:  # the data store's address, for kt.put/get in the ranks
            from ktlite_server.store import remember
            remember(msg["store"], pod.pod_ips_file)
        # a launch is installed once: a caller that lost the answer (a proxy dropped it) sends
        # the same launch again and gets the same answer
        deploys: collections.OrderedDict[str, asyncio.Task[Any]] = state["deploys"]
        task = deploys.get(dep.launch_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(pod.deploy(dep, restart=bool(msg.get("restart"))))
            deploys[dep.launch_id] = task
            while len(deploys) > 8:
                deploys.popitem(last=False)
        outs: list[Any] = await asyncio.shield(task)
        return outs

    async def boot_launch(path: str) -> None:
        """A replica started by an autoscaler loads the launch the client left for it (a
        mounted Secret on Kubernetes, a file locally) before it reports ready."""
        try:
            with open(path, "rb") as f:
                data = f.read()
            if data[:2] == b"\x1f\x8b":  # gzip: a launch kept in a Kubernetes Secret
                data = gzip.decompress(data)
            msg = protocol.loads(data)
        except FileNotFoundError:
            state["boot"] = "no launch yet: waiting for the client's POST /deploy"
            return
        except Exception as e:  # noqa: BLE001 - shown by /health?ready=1 and the log
            state["boot"] = f"the launch file {path} could not be read: {type(e).__name__}: {e}"
            logger.error("%s", state["boot"])
            return
        try:
            outs = await install(msg)
        except HTTPException as e:
            state["boot"] = f"the launch file {path} was refused: {e.detail}"
            logger.error("%s", state["boot"])
            return
        failed = [o for o in outs if o.status != "ok"]
        state["boot"] = (f"loading launch {msg.get('launch_id')} failed on rank(s) "
                         f"{', '.join(str(o.rank) for o in failed)}: {failed[0].message}" if failed else None)
        if failed:
            logger.error("%s", state["boot"])

    async def _colocate(msg: dict[str, Any], name: str, target: Colocated | None) -> Response:
        """A colocation launch (``kt.cls(B).to(remote_a)``): add, replace or (``drop``) remove
        a named target in the rank processes of the deployment this pod serves."""
        if pod.dep is None:
            raise HTTPException(409, f"pod {pod.name} has no code deployed to colocate {name!r} with; "
                                "deploy the first group again")
        if msg.get("launch_id") and msg["launch_id"] != pod.dep.launch_id and target is not None:
            raise HTTPException(409, f"pod {pod.name} runs launch {pod.dep.launch_id}, not "
                                f"{msg['launch_id']}: the deployment to colocate {name!r} with was "
                                "redeployed since")
        outs = await pod.colocate(name, target, if_missing=bool(msg.get("if_missing")))
        parts = protocol.gather_parts([(o.rank, pod.name, o.status, o.data, o.message, o.at) for o in outs])
        return Response(b"".join(bytes(memoryview(p)) for p in parts), media_type="application/octet-stream")

    @app.post("/call")
    async def call(request: Request) -> Response:
        authorize(request)
        try:
            plan = CallPlan(json.loads(request.headers.get(protocol.CALL_HEADER, "")))
            resume = _resume_from(request)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise HTTPException(400, f"malformed {protocol.CALL_HEADER} header: {type(e).__name__}: "
                                     f"{str(e)[:300]}") from e
        streams: Streams = state["streams"]
        live = streams.get(plan.id)
        # a request for a call this pod holds attaches to it (once its first request told
        # whether it runs: its body may still be arriving)
        if live is not None and await live.decided():
            # the same call again (the caller lost its stream): never a second run
            await _discard_body(request)
            return StreamResponse(live, resume or 0)
        if resume is not None:  # a re-attach: never runs anything
            await _discard_body(request)
            if streams.ended_before(plan.id):
                raise HTTPException(410, f"call {plan.id} ended on pod {pod.name} and its result is no "
                                         f"longer kept (it waits {RETAIN_S:g}s for a caller to re-attach)")
            raise HTTPException(404, f"pod {pod.name} does not know call {plan.id}: its server restarted "
                                     "since the call began, and the call was lost with it")
        if pod.dep is None:
            raise HTTPException(409, f"pod {pod.name} has no code deployed: its server started after the "
                                "deploy (a restarted container, a replaced pod); call .to() again, which "
                                "pushes the code and reuses the pods",
                                headers={protocol.UPTIME_HEADER: f"{max(0.0, time.time() - started):.3f}"})
        if plan.launch_id and plan.launch_id != pod.dep.launch_id:
            raise HTTPException(409, f"pod {pod.name} runs launch {pod.dep.launch_id}, not the caller's "
                                f"{plan.launch_id}: it was redeployed since (by another process, or it "
                                "restarted); call .to() again")
        coordinator = Coordinator(pod, token, state["client"], state["peers"], plan) if plan.fanout else None

        def abandoned() -> None:
            if coordinator is not None:
                coordinator.cancel("cancelled", "the caller disconnected")
            else:
                pod.cancel(plan.id, "cancelled", "the caller disconnected")

        stream = streams.open(plan.id, plan.reattach, abandoned)
        own_file = plan.shm is None
        try:
            if plan.shm is None:
                body, path = await _read_body(request, max_body)
            else:  # the caller shares this host and wrote the arguments to shared memory
                try:
                    path = shm.check(str(plan.shm[0]), shm.ARG_PREFIX)
                    body = shm.map_private(path, int(plan.shm[1]))
                except (ValueError, OSError, IndexError, TypeError) as e:
                    raise HTTPException(400, f"bad shared-memory argument: {e}") from e
            try:
                if plan.per_rank is None:
                    protocol.split(body)  # framing only: the server never unpickles user data
                else:  # the shared message, then this pod's ranks' items
                    view = memoryview(body).cast("B")
                    shared = plan.per_rank["shared"]
                    protocol.split(view[:shared])
                    for off, n in plan.per_rank["items"]:
                        if off + n > view.nbytes:
                            raise protocol.ProtocolError(f"per-rank item at {off}+{n} runs past the body "
                                                         f"({view.nbytes} bytes)")
            except protocol.ProtocolError as e:
                if path and own_file:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                raise HTTPException(400, f"malformed call body: {e}") from e
        except BaseException:
            streams.refused(stream)
            raise
        stream.decide(True)
        if LOG_BODIES:
            logger.info("call %s: received %d bytes over HTTP", plan.id, memoryview(body).nbytes if plan.shm is None else 0)
        coordinators: dict[str, Coordinator] = state["coordinators"]
        if coordinator is not None:
            coordinators[plan.id] = coordinator
            early = pod.cancelled_early.get(plan.id)
            if early is not None:  # the caller's cancel overtook the call: it starts stopped everywhere
                coordinator.cancel(*early)

        async def produce() -> None:
            try:
                if coordinator is not None and pod.dep is not None and pod.dep.concurrency == 1 \
                        and pod.dep.config.world_size > 1:
                    # collectives must run in the same order on every rank: a distributed
                    # deployment runs its calls one at a time, in the order they arrived here
                    async with pod.order:
                        outs = await coordinator.run(body, path, stream.emit)
                elif coordinator is not None:
                    outs = await coordinator.run(body, path, stream.emit)
                else:
                    outs = await run_local(pod, plan, body, path, stream.emit)
                if coordinator is not None and any(o[2] != "ok" for o in outs):
                    # a failed or stopped call may leave ranks out of step in their process
                    # group: the next call forms a new one (every rank, on a new port)
                    pod.next_generation()
                started = coordinator.started if coordinator is not None else True
                stream.emit(protocol.frame_parts(protocol.RESULT, protocol.gather_parts(outs, started)))
            except Exception as e:  # noqa: BLE001 - infrastructure failure: tell the caller
                stream.emit(protocol.error_frame(type(e).__name__, str(e)))
            finally:
                if path and own_file:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                coordinators.pop(plan.id, None)
                streams.finished(stream)

        asyncio.get_running_loop().create_task(produce())
        return StreamResponse(stream, 0)

    @app.post("/restart_failed")
    async def restart_failed(request: Request) -> JSONResponse:
        """Restart this pod's dead rank processes (only those: the others keep their state)."""
        authorize(request)
        if pod.dep is None:
            raise HTTPException(409, f"pod {pod.name} has no code deployed; call .to() first")
        result = await pod.restart_failed()
        if result["restarted"] or request.query_params.get("regroup", "").lower() in ("1", "true", "yes"):
            pod.next_generation()  # on pod 0 this re-forms the process group at the next call
        return JSONResponse({**result, "generation": pod.generation})

    @app.post("/cancel/{call_id}")
    async def cancel(call_id: str, request: Request) -> JSONResponse:
        authorize(request)  # before anything of the request is looked at
        query = request.query_params
        kind = query.get("kind", "cancelled")
        reason = query.get("reason", "cancelled by the caller")
        reset = query.get("reset", "false").lower() in ("1", "true", "yes")
        if kind not in ("cancelled", "timeout"):
            raise HTTPException(400, f"kind={kind!r}; allowed: cancelled, timeout")
        coordinator = state["coordinators"].get(call_id)
        if coordinator is not None:  # this pod coordinates the call: stop it on every pod
            coordinator.cancel(kind, reason[:500])
        found = pod.cancel(call_id, kind, reason[:500])
        if not found and reset:
            pod.reset()
        return JSONResponse({"cancelled": found})

    return FastCall(app, call)
