"""The data store's server: ``python -m ktlite_server`` with ``KTLITE_STORE_ROOT`` set serves
that directory (a PVC on Kubernetes) as ktlite's data store instead of running code.

Wire contract (every endpoint but ``/health`` needs ``x-ktlite-token: Bearer <store token>``;
keys go as the ``key`` query parameter and are checked by ``ktlite_wire.storedir.check_key``):

- ``GET /health``
- ``GET /store/v1/stat?key=K`` → the entry ``{"key", "name", "type", "size"}``
- ``GET /store/v1/ls?prefix=P&recursive=0|1`` → a list of entries
- ``PUT /store/v1/key?key=K&kind=file|object|dir`` with the value as the body (a tar stream
  for ``dir``), streamed to disk and renamed into place when complete → the entry
- ``GET /store/v1/key?key=K`` → the value (a tar stream for a directory) with its exact
  Content-Length and the entry as JSON in ``x-ktlite-entry``
- ``DELETE /store/v1/key?key=K&recursive=0|1``

Errors: 400 a bad key (JSON ``detail``), 401 a wrong token, 404 a missing key, 409 a key of
another type, 413 a body declared larger than allowed (``KTLITE_STORE_MAX_BODY`` for a PUT,
1 TiB by default; no body for the rest).

The token and the declared size are checked from the request head, before the endpoint runs,
by the pod server's own gate (:class:`ktlite_server.admission.Gate`): a refused request's
body is never read, and its connection is closed. The connection limits are the pod
server's too (:mod:`ktlite_server.connections`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import queue
import threading
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ktlite_server.admission import Gate, Token
from ktlite_server.connections import Limits, guarded
from ktlite_server.logconfig import request_log
from ktlite_server.refusal import refuse
from ktlite_wire import privatefiles
from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import LENGTH_HEADER
from ktlite_wire.storedir import OBJECT_MAGIC, StoreDir, StoreFault, check_key
from ktlite_wire.version import PROTOCOL_VERSION

PREFIX = "/store/v1"
_END = object()
MAX_BODY = 1 << 40  # KTLITE_STORE_MAX_BODY: one value (a file, an object, a directory's tar)


class StoreGate(Gate):
    """The pod server's gate with the store's paths: only a PUT of a value takes a body."""

    large_bodies = frozenset({PREFIX + "/key"})
    token_name = "store token"
    body_limit_name = "KTLITE_STORE_MAX_BODY"


def store_limits(environ: Mapping[str, str] = os.environ) -> Limits:
    """The pod server's limits (its ``KTLITE_*`` variables), with the store's body limit."""
    raw = environ.get("KTLITE_STORE_MAX_BODY") or str(MAX_BODY)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"KTLITE_STORE_MAX_BODY={raw!r}: must be a positive whole number of bytes")
    return dataclasses.replace(Limits.from_env(environ), max_body=int(raw))


_STATUS = {ErrorCode.BAD_REQUEST: 400, ErrorCode.NOT_FOUND: 404}


def _fail(e: StoreFault) -> HTTPException:
    """The answer to a store fault: by its code, never by its text."""
    return refuse(_STATUS.get(e.code, 409), e.code, str(e))


class _BodyReader:
    """A blocking file over a request body fed chunk by chunk from the event loop (a tar
    stream is unpacked in a thread while it arrives)."""

    def __init__(self) -> None:
        self.q: queue.Queue[Any] = queue.Queue(maxsize=16)
        self.buf = b""
        self.done = False

    def read(self, n: int = -1) -> bytes:
        while not self.done and (n < 0 or len(self.buf) < n):
            item = self.q.get()
            if item is _END:
                self.done = True
            elif isinstance(item, BaseException):
                self.done = True  # the feeder stopped: nothing more will come
                raise item
            else:
                self.buf += item
        if n < 0:
            out, self.buf = self.buf, b""
        else:
            out, self.buf = self.buf[:n], self.buf[n:]
        return out


def create_store_app(root: str, token: str, limits: Limits | None = None) -> StoreGate:
    """The store server's ASGI app: its endpoints behind the gate that refuses from the head."""
    app = _endpoints(StoreDir(root, where="of this namespace (the ktlite-store pod)"))
    return StoreGate(app, Token(token), limits or store_limits(), pod_name="ktlite-store")


def _endpoints(store: StoreDir) -> FastAPI:
    """The store's endpoints; every request reaching them carries the token (the gate's)."""
    app = FastAPI(title="ktlite data store", docs_url=None, redoc_url=None, openapi_url=None)

    def key_of(request: Request, name: str = "key", allow_root: bool = False) -> str:
        try:
            return check_key(request.query_params.get(name, ""), what=name, allow_root=allow_root)
        except StoreFault as e:
            raise _fail(e) from None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "store": True, "protocol": PROTOCOL_VERSION}

    @app.get(PREFIX + "/stat")
    async def stat(request: Request) -> dict[str, Any]:
        key = key_of(request)
        entry = await asyncio.to_thread(store.entry, key)
        if entry is None:
            raise _fail(
                StoreFault(
                    f"no key {key!r} in the data store of this namespace", key, ErrorCode.NOT_FOUND
                )
            )
        return entry

    @app.get(PREFIX + "/ls")
    async def ls(request: Request) -> JSONResponse:
        prefix = key_of(request, "prefix", allow_root=True)
        recursive = request.query_params.get("recursive", "0") in ("1", "true")
        try:
            return JSONResponse(await asyncio.to_thread(store.ls, prefix, recursive))
        except StoreFault as e:
            raise _fail(e) from None

    @app.delete(PREFIX + "/key")
    async def remove(request: Request) -> dict[str, Any]:
        key = key_of(request, allow_root=True)
        recursive = request.query_params.get("recursive", "0") in ("1", "true")
        try:
            return await asyncio.to_thread(store.remove, key, recursive)
        except StoreFault as e:
            raise _fail(e) from None

    @app.put(PREFIX + "/key")
    async def put(request: Request) -> dict[str, Any]:
        key = key_of(request)
        kind = request.query_params.get("kind", "file")
        if kind not in ("file", "object", "dir"):
            raise refuse(400, ErrorCode.BAD_REQUEST, f"kind={kind!r}; allowed: file, object, dir")
        length = request.headers.get(LENGTH_HEADER) or request.headers.get("content-length")
        expected_size = int(length) if length and length.isdigit() else None
        try:
            if kind == "dir":
                return await _put_tar(request, key)
            return await _put_file(request, key, kind, expected_size)
        except StoreFault as e:
            raise _fail(e) from None
        except ClientDisconnect:
            raise refuse(
                400, ErrorCode.BAD_REQUEST, "the client left before the upload was complete"
            ) from None

    async def _put_file(
        request: Request, key: str, kind: str, expected_size: int | None
    ) -> dict[str, Any]:
        staged = store.staging()
        got = 0
        try:
            with open(staged, "wb") as f:
                if kind == "object":
                    f.write(OBJECT_MAGIC)
                async for chunk in request.stream():
                    f.write(chunk)
                    got += len(chunk)
                if expected_size is not None and got != expected_size:
                    raise refuse(
                        400,
                        ErrorCode.BAD_REQUEST,
                        f"upload of {key!r} truncated: got {got} of {expected_size} bytes",
                    )
                f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())
            await asyncio.to_thread(store.install, staged, key)
        except BaseException:
            with contextlib.suppress(OSError):
                staged.unlink()
            raise
        entry = store.entry(key)
        assert entry is not None
        return entry

    async def _put_tar(request: Request, key: str) -> dict[str, Any]:
        reader = _BodyReader()
        result: dict[str, Any] = {}

        def unpack() -> None:
            try:
                result["entry"] = store.write_tar(key, reader)  # type: ignore[arg-type]
            except BaseException as e:  # noqa: BLE001 - handed to the request
                result["error"] = e
            finally:
                while not reader.done:  # drain, so the feeder never blocks on a full queue
                    with contextlib.suppress(BaseException):
                        reader.read(1 << 20)

        thread = threading.Thread(target=unpack, daemon=True)
        thread.start()
        try:
            async for chunk in request.stream():
                await asyncio.to_thread(reader.q.put, chunk)
            await asyncio.to_thread(reader.q.put, _END)
        except BaseException as e:
            await asyncio.to_thread(
                reader.q.put, StoreFault(f"upload of {key!r} broke: {e!r}", key)
            )
            await asyncio.to_thread(thread.join, 60)
            raise
        await asyncio.to_thread(thread.join)
        if "error" in result:
            error = result["error"]
            if isinstance(error, StoreFault):
                raise error
            raise refuse(
                400, ErrorCode.BAD_REQUEST, f"could not unpack the directory for {key!r}: {error}"
            )
        return dict(result["entry"])

    @app.get(PREFIX + "/key")
    async def get(request: Request) -> Response:
        key = key_of(request)
        try:
            entry = await asyncio.to_thread(store.entry, key)
            if entry is None:
                raise store.missing(key)
            if entry["type"] == "dir":
                size, chunks = await asyncio.to_thread(store.tar, key)
            else:
                f, opened = await asyncio.to_thread(store.open, key)
                entry = opened
                size, chunks = opened["size"], _read(f)
        except StoreFault as e:
            raise _fail(e) from None
        headers = {"content-length": str(size), "x-ktlite-entry": json.dumps(entry)}
        return StreamingResponse(chunks, headers=headers, media_type="application/octet-stream")

    return app


def _read(f: Any) -> Any:
    with f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return
            yield chunk


def serve(root: str, token: str, host: str, port: int, ready_file: str | None) -> None:
    """Run the store server until SIGTERM."""
    import importlib.util
    import signal
    import socket

    import uvicorn

    try:
        limits = store_limits()  # bounded heads, header and idle timeouts, a connection cap
    except ValueError as e:
        raise SystemExit(f"ktlite_server: {e}") from None
    app = request_log(create_store_app(root, token, limits))  # each request at DEBUG
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(
        app,
        log_level=os.environ.get("KTLITE_SERVER_LOG_LEVEL", "warning"),
        access_log=False,
        timeout_graceful_shutdown=3,
        http=guarded(limits),
        timeout_keep_alive=limits.idle_timeout,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)

    async def run() -> None:
        serving = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.005)
        if server.started and ready_file:
            privatefiles.write_file(
                ready_file, json.dumps({"port": sock.getsockname()[1], "pid": os.getpid()})
            )
        await serving

    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    with contextlib.suppress(KeyboardInterrupt):
        if importlib.util.find_spec("uvloop"):  # as the pod server runs
            import uvloop

            uvloop.run(run())
        else:
            asyncio.run(run())


def remember(info: Any, pod_ips_file: str) -> None:
    """Keep the store address a deploy message brought (for this pod's ranks; mode 0600: it
    holds the store token); ``{"url": None}`` means the namespace has no store (any old
    address goes); a message without one changes nothing."""
    from ktlite_wire.storedir import address_file

    if not isinstance(info, dict):
        return
    path = address_file(pod_ips_file)
    if not info.get("url"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    privatefiles.write_file(
        path, json.dumps({k: info.get(k) for k in ("url", "token", "pod", "namespace")})
    )
