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
- ``DELETE /store/v1/key?key=K&recursive=0|1`` (never the root: 400)
- ``POST /store/v1/wipe`` → ``{"removed": N}``: every key deleted (``ktlite store wipe``)

Errors: 400 a bad key (JSON ``detail``), 401 a wrong token, 403 a key outside the token's
scope (:mod:`ktlite_wire.storescope`), 404 a missing key, 409 a key of another type, 413 a body
declared larger than allowed (``KTLITE_STORE_MAX_BODY`` for a PUT, 1 TiB by default; no body
for the rest), 507 an upload that would take the store over ``KTLITE_STORE_MAX_BYTES``
(:mod:`ktlite_wire.storecap`; checked before the body is read and while it streams).

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
from ktlite_wire.headers import LENGTH_HEADER, TOKEN_HEADER
from ktlite_wire.storecap import Cap, Usage, max_bytes
from ktlite_wire.storedir import OBJECT_MAGIC, StoreDir, StoreFault, check_key
from ktlite_wire.storescope import Scope, scope_of
from ktlite_wire.version import PROTOCOL_VERSION

PREFIX = "/store/v1"
_END = object()
MAX_BODY = 1 << 40  # KTLITE_STORE_MAX_BODY: one value (a file, an object, a directory's tar)


class StoreGate(Gate):
    """The pod server's gate with the store's paths: only a PUT of a value takes a body."""

    large_bodies = frozenset({PREFIX + "/key"})
    large_prefixes = ()
    token_name = "store token"
    body_limit_name = "KTLITE_STORE_MAX_BODY"


class StoreKey(Token):
    """The store's master key: the full token, and the key scoped tokens are checked with
    (:mod:`ktlite_wire.storescope`); never shown."""

    def __init__(self, master: str) -> None:
        super().__init__(master)
        self._master = master

    def scope(self, header: bytes | str | None) -> Scope | None:
        """What the token of a request's header reaches; None for no valid token."""
        if isinstance(header, str):
            header = header.encode("latin-1", "replace")
        if not header or not header.startswith(b"Bearer "):
            return None
        return scope_of(self._master, header[len(b"Bearer ") :].decode("latin-1"))

    def matches(self, header: bytes | None) -> bool:
        return self.scope(header) is not None


_GRANT_FIX = (
    "grant it from your machine with kt.Compute(store_access={prefix: 'read' or 'write'}) "
    "and call .to() again"
)


def allowed(scope: Scope, key: str, write: bool) -> None:
    """Refuse (403) a key outside what the request's token reaches."""
    if (scope.may_write if write else scope.may_read)(key):
        return
    verb = "write" if write else "read"
    what = f"key {key!r}" if key else "the store's root (every key)"
    raise refuse(
        403,
        ErrorCode.FORBIDDEN,
        f"{scope.describe()} may not {verb} {what}" + ("" if not key else f"; {_GRANT_FIX}"),
        headers={"connection": "close"},
    )


def store_limits(environ: Mapping[str, str] = os.environ) -> Limits:
    """The pod server's limits (its ``KTLITE_*`` variables), with the store's body limit."""
    raw = environ.get("KTLITE_STORE_MAX_BODY") or str(MAX_BODY)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"KTLITE_STORE_MAX_BODY={raw!r}: must be a positive whole number of bytes")
    return dataclasses.replace(Limits.from_env(environ), max_body=int(raw))


_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.STORE_FULL: 507,
}


def _fail(e: StoreFault) -> HTTPException:
    """The answer to a store fault: by its code, never by its text."""
    status = _STATUS.get(e.code, 409)
    # a refused upload's body is left unread: the connection cannot carry another request
    return refuse(
        status, e.code, str(e), headers={"connection": "close"} if status == 507 else None
    )


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


def create_store_app(
    root: str, token: str, limits: Limits | None = None, cap: int | None = None
) -> StoreGate:
    """The store server's ASGI app: its endpoints behind the gate that refuses from the head.
    ``cap``: the bytes the store may hold (``KTLITE_STORE_MAX_BYTES``; None: no cap)."""
    key = StoreKey(token)
    app = _endpoints(StoreDir(root, where="of this namespace (the ktlite-store pod)"), key, cap)
    return StoreGate(app, key, limits or store_limits(), pod_name="ktlite-store")


def _endpoints(store: StoreDir, master: StoreKey, cap: int | None = None) -> FastAPI:
    """The store's endpoints; every request reaching them carries a valid token (the gate's),
    and each checks that the token's scope reaches its key."""
    app = FastAPI(title="ktlite data store", docs_url=None, redoc_url=None, openapi_url=None)
    usage = Usage(store)  # what the store holds, for KTLITE_STORE_MAX_BYTES

    def may(request: Request, key: str, write: bool = False) -> None:
        scope = master.scope(request.headers.get(TOKEN_HEADER))
        if scope is None:  # the gate admitted it: only a token changed under us
            raise refuse(401, ErrorCode.UNAUTHORIZED, "missing or wrong store token")
        allowed(scope, key, write)

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
        may(request, key)
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
        may(request, prefix)
        recursive = request.query_params.get("recursive", "0") in ("1", "true")
        try:
            return JSONResponse(await asyncio.to_thread(store.ls, prefix, recursive))
        except StoreFault as e:
            raise _fail(e) from None

    @app.delete(PREFIX + "/key")
    async def remove(request: Request) -> dict[str, Any]:
        key = key_of(request, allow_root=True)
        may(request, key, write=True)
        recursive = request.query_params.get("recursive", "0") in ("1", "true")
        try:
            entry = await asyncio.to_thread(store.remove, key, recursive)
        except StoreFault as e:
            raise _fail(e) from None
        usage.add(-int(entry["size"]))
        return entry

    @app.post(PREFIX + "/wipe")
    async def wipe(request: Request) -> dict[str, Any]:
        may(request, "", write=True)
        removed = await asyncio.to_thread(store.wipe)
        usage.forget()
        return {"removed": removed}

    @app.put(PREFIX + "/key")
    async def put(request: Request) -> dict[str, Any]:
        key = key_of(request)
        may(request, key, write=True)
        kind = request.query_params.get("kind", "file")
        if kind not in ("file", "object", "dir"):
            raise refuse(400, ErrorCode.BAD_REQUEST, f"kind={kind!r}; allowed: file, object, dir")
        length = request.headers.get(LENGTH_HEADER) or request.headers.get("content-length")
        expected_size = int(length) if length and length.isdigit() else None
        try:
            # before any of the body is read: what the store holds and what is declared
            old = await asyncio.to_thread(store.entry, key)
            replacing = int((old or {}).get("size") or 0)
            room = await asyncio.to_thread(Cap, usage, key, cap, expected_size, replacing)
            try:
                if kind == "dir":
                    entry = await _put_tar(request, key, room)
                else:
                    entry = await _put_file(request, key, kind, expected_size, room)
                usage.add(int(entry["size"]) - replacing)
                return entry
            finally:
                room.close()
        except StoreFault as e:
            raise _fail(e) from None
        except ClientDisconnect:
            raise refuse(
                400, ErrorCode.BAD_REQUEST, "the client left before the upload was complete"
            ) from None

    async def _put_file(
        request: Request, key: str, kind: str, expected_size: int | None, room: Cap
    ) -> dict[str, Any]:
        staged = store.staging()
        got = 0
        try:
            with open(staged, "wb") as f:
                if kind == "object":
                    f.write(OBJECT_MAGIC)
                async for chunk in request.stream():
                    room.add(len(chunk))  # StoreFull once over the cap: the staged file goes
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

    async def _put_tar(request: Request, key: str, room: Cap) -> dict[str, Any]:
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
                room.add(len(chunk))  # over the cap: the unpacking stops, its staging goes
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
        may(request, key)
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
        cap = max_bytes(os.environ)  # KTLITE_STORE_MAX_BYTES: what the whole store may hold
    except ValueError as e:
        raise SystemExit(f"ktlite_server: {e}") from None
    app = request_log(create_store_app(root, token, limits, cap))  # each request at DEBUG
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


# what a deploy message brings about the store: its address, the deployment's scoped token,
# its name and the signing keys of its prefixes (ktlite.datastore.location.handoff)
_HANDED = ("url", "token", "pod", "namespace", "name", "keys", "writes")


def remember(info: Any, pod_ips_file: str) -> None:
    """Keep the store address a deploy message brought (for this pod's ranks; mode 0600: it
    holds the deployment's store token and signing keys); ``{"url": None}`` means the namespace has no store (any old
    address goes); a message without one changes nothing."""
    from ktlite_wire.storedir import address_file

    if not isinstance(info, dict):
        return
    path = address_file(pod_ips_file)
    if not info.get("url"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    privatefiles.write_file(path, json.dumps({k: info.get(k) for k in _HANDED}))
