"""The pod server's HTTP API (FastAPI on uvicorn).

Endpoints (all but ``/health`` need ``x-ktlite-token: Bearer <deployment token>``):

- ``GET /health``: liveness, protocol version, launch id.
- ``POST /deploy``: install a code bundle on this pod's ranks (ktlite message body).
- ``POST /call``: run a call; ``x-ktlite-call`` header carries the plan, the body the opaque
  argument payload; answers with a frame stream (logs, heartbeats, then the result).
- ``POST /cancel/{call_id}``: stop a running call's ranks.
- ``GET /status``: each rank's state, last exit, restarts, and how long it has been busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import mmap
import os
import platform
import tempfile
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
from ktlite_server.pod import DEFAULT_STUCK_AFTER_S, Deployment, Pod

HEARTBEAT_S = 2.0
_PENDING = object()
DEFAULT_MAX_BODY = 8 << 30


class FrameResponse(Response):
    """Streams frames produced by ``producer`` while the call runs; heartbeats when idle."""

    media_type = "application/x-ktlite-frames"

    def __init__(self, producer: Callable[[Callable[[Any], None]], Awaitable[None]],
                 on_disconnect: Callable[[], None]) -> None:
        super().__init__(status_code=200, media_type=self.media_type)
        self.producer = producer
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def produce() -> None:
            try:
                await self.producer(queue.put_nowait)
            except Exception as e:  # noqa: BLE001 - infrastructure failure: tell the caller
                queue.put_nowait(protocol.error_frame(type(e).__name__, str(e)))
            finally:
                queue.put_nowait(None)

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    self.on_disconnect()
                    return

        def beat() -> None:  # a timer, not a task: most calls end long before the first beat
            queue.put_nowait(protocol.frame(protocol.HEARTBEAT, b""))
            nonlocal heart
            heart = loop.call_later(HEARTBEAT_S, beat)

        task = loop.create_task(produce())
        watcher = loop.create_task(watch())
        heart = loop.call_later(HEARTBEAT_S, beat)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", self.media_type.encode())]})
        try:
            finished = False
            item = await queue.get()
            while item is not None:
                # the result is followed at once by the end marker: send both in one write
                after = queue.get_nowait() if not queue.empty() else _PENDING
                chunks = list(protocol.chunked(item if isinstance(item, list) else [item])) or [b""]
                for i, chunk in enumerate(chunks):
                    finished = after is None and i == len(chunks) - 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": not finished})
                item = await queue.get() if after is _PENDING else after
            if not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            heart.cancel()
            if not task.done():
                self.on_disconnect()
                await task


async def _read_body(request: Request, limit: int) -> tuple[Any, str | None]:
    """Read the body into memory, or straight into a shared-memory file when large."""
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise HTTPException(411, "a Content-Length header is required")
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
                response = JSONResponse({"detail": e.detail}, status_code=e.status_code)
            except ClientDisconnect:
                return  # the caller left mid-upload: nothing to answer, nothing ran
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(pod: Pod, token: str, *, max_body: int = DEFAULT_MAX_BODY,
               client: httpx.AsyncClient | None = None) -> FastCall:
    """Build the pod server app; ``client`` is the HTTP client used to reach peer pods."""
    expected = protocol.bearer(token).encode()
    state: dict[str, Any] = {"client": client, "peers": PeerPool()}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        if state["client"] is None:
            state["client"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=30.0)
        await pod.prespawn()
        yield
        await pod.shutdown()
        await state["client"].aclose()
        await state["peers"].aclose()

    app = FastAPI(title="ktlite pod server", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    def authorize(request: Request) -> None:
        got = request.headers.get(protocol.TOKEN_HEADER, "").encode()
        if not hmac.compare_digest(got, expected):
            raise HTTPException(401, "missing or wrong deployment token")
        version = request.headers.get(protocol.VERSION_HEADER)
        if version is not None and version != str(protocol.PROTOCOL_VERSION):
            raise HTTPException(409, f"protocol version mismatch: client speaks {version}, server "
                                     f"(ktlite {ktlite.__version__}) speaks {protocol.PROTOCOL_VERSION}; "
                                     "install the same ktlite version on both sides")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "protocol": protocol.PROTOCOL_VERSION, "version": ktlite.__version__,
                "python": platform.python_version(), "pod": pod.name, "ordinal": pod.ordinal,
                "launch_id": pod.dep.launch_id if pod.dep else None}

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        authorize(request)
        try:
            stuck_after = float(request.query_params.get("stuck_after", DEFAULT_STUCK_AFTER_S))
        except ValueError:
            raise HTTPException(400, "stuck_after must be a number of seconds") from None
        return pod.status(stuck_after)

    @app.post("/deploy")
    async def deploy(request: Request) -> Response:
        authorize(request)
        body, path = await _read_body(request, max_body)
        try:
            msg = protocol.loads(body)
            dep = Deployment(
                launch_id=msg["launch_id"], bundle=bytes(msg["bundle"]), kind=msg["kind"],
                init=msg.get("init"), sources=msg.get("sources") or {},
                config=DistributedConfig(**msg["distributed"]), pod_ips=list(msg["pod_ips"]),
                ordinal=int(msg["ordinal"]), master_port=int(msg["master_port"]),
                max_restarts=int(msg.get("max_restarts", 3)), cpus=msg.get("cpus"),
                load_timeout=float(msg.get("load_timeout", 300)))
            # the same env every rank would get: a bad layout is refused here, before it
            # replaces the deployment the pod is serving
            distributed_env(dep.config, node_rank=dep.ordinal, local_rank=0, pod_ips=dep.pod_ips,
                            master_port=dep.master_port)
            if not 0 <= dep.ordinal < dep.config.workers:
                raise ValueError(f"ordinal {dep.ordinal} is outside 0..{dep.config.workers - 1}")
        except Exception as e:  # noqa: BLE001 - any undecodable or inconsistent body is the client's fault
            raise HTTPException(400, f"malformed deploy request: {type(e).__name__}: {e}") from e
        finally:
            if path:
                os.unlink(path)
        if dep.ordinal != pod.ordinal:
            raise HTTPException(400, f"deploy for ordinal {dep.ordinal} sent to pod {pod.name} "
                                     f"(ordinal {pod.ordinal})")
        outs = await pod.deploy(dep, restart=bool(msg.get("restart")))
        parts = protocol.gather_parts([(o.rank, pod.name, o.status, o.data, o.message, o.at) for o in outs])
        return Response(b"".join(bytes(memoryview(p)) for p in parts), media_type="application/octet-stream")

    @app.post("/call")
    async def call(request: Request) -> Response:
        authorize(request)
        try:
            plan = CallPlan(json.loads(request.headers.get(protocol.CALL_HEADER, "")))
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise HTTPException(400, f"malformed {protocol.CALL_HEADER} header: {type(e).__name__}: "
                                     f"{str(e)[:300]}") from e
        if pod.dep is None:
            raise HTTPException(409, f"pod {pod.name} has no code deployed: its server started after the "
                                "deploy (a restarted container, a replaced pod); call .to() again, which "
                                "pushes the code and reuses the pods")
        if plan.launch_id and plan.launch_id != pod.dep.launch_id:
            raise HTTPException(409, f"pod {pod.name} runs launch {pod.dep.launch_id}, not the caller's "
                                f"{plan.launch_id}: it was redeployed since (by another process, or it "
                                "restarted); call .to() again")
        own_file = plan.shm is None
        if plan.shm is None:
            body, path = await _read_body(request, max_body)
        else:  # the caller shares this host and wrote the arguments to shared memory
            try:
                path = shm.check(str(plan.shm[0]), shm.ARG_PREFIX)
                body = shm.map_private(path, int(plan.shm[1]))
            except (ValueError, OSError, IndexError, TypeError) as e:
                raise HTTPException(400, f"bad shared-memory argument: {e}") from e
        try:
            protocol.split(body)  # framing only: the server never unpickles user data
        except protocol.ProtocolError as e:
            if path and own_file:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise HTTPException(400, f"malformed call body: {e}") from e
        coordinator = Coordinator(pod, token, state["client"], state["peers"], plan) if plan.fanout else None

        async def produce(emit: Callable[[Any], None]) -> None:
            try:
                if coordinator is not None:
                    outs = await coordinator.run(body, path, emit)
                else:
                    outs = await run_local(pod, plan, body, path, emit)
                emit(protocol.frame_parts(protocol.RESULT, protocol.gather_parts(outs)))
            finally:
                if path and own_file:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

        def disconnected() -> None:
            if coordinator is not None:
                coordinator.cancel("cancelled", "the caller disconnected")
            else:
                pod.cancel(plan.id, "cancelled", "the caller disconnected")

        return FrameResponse(produce, disconnected)

    @app.post("/cancel/{call_id}")
    async def cancel(call_id: str, request: Request) -> JSONResponse:
        authorize(request)  # before anything of the request is looked at
        query = request.query_params
        kind = query.get("kind", "cancelled")
        reason = query.get("reason", "cancelled by the caller")
        reset = query.get("reset", "false").lower() in ("1", "true", "yes")
        if kind not in ("cancelled", "timeout"):
            raise HTTPException(400, f"kind={kind!r}; allowed: cancelled, timeout")
        found = pod.cancel(call_id, kind, reason[:500])
        if not found and reset:
            pod.reset()
        return JSONResponse({"cancelled": found})

    return FastCall(app, call)
