"""Request bodies: read into memory (or a shared-memory file when large), or discarded."""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import tempfile
from typing import Any

from fastapi import HTTPException, Request
from starlette.requests import ClientDisconnect

from ktlite_server import directbody
from ktlite_server.refusal import refuse
from ktlite_wire import shm
from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import LENGTH_HEADER


async def read_body(request: Request, limit: int) -> tuple[Any, str | None]:
    """Read the body into memory, or straight into a shared-memory file when large."""
    # a chunked body (through a proxy) names its length in LENGTH_HEADER
    length = request.headers.get("content-length") or request.headers.get(LENGTH_HEADER)
    if length is None or not length.isdigit():
        raise refuse(
            411,
            ErrorCode.LENGTH_REQUIRED,
            f"a Content-Length (or {LENGTH_HEADER}) header is required",
        )
    n = int(length)
    if n > limit:
        raise refuse(
            413,
            ErrorCode.TOO_LARGE,
            f"body of {n} bytes is larger than this server's limit of {limit} bytes "
            "(KTLITE_MAX_BODY)",
        )
    into = request.scope.get("extensions", {}).get(directbody.BODY_INTO)
    if into is not None and n >= directbody.DIRECT_MIN and "content-length" in request.headers:
        # the server's protocol reads it past uvicorn's receive()
        direct = await _read_direct(functools.partial(into, request.scope, n), n)
        if direct is not None:
            return direct
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
                raise refuse(
                    400,
                    ErrorCode.BAD_REQUEST,
                    f"body is longer than its Content-Length of {n} bytes",
                )
            view[got : got + k] = chunk
            got += k
    except (ClientDisconnect, HTTPException):
        if path:
            os.unlink(path)
        raise
    if got != n:
        if path:
            os.unlink(path)
        raise refuse(400, ErrorCode.BAD_REQUEST, f"body truncated: got {got} of {n} bytes")
    return view, path


async def discard_body(request: Request) -> None:
    """Read a body this request does not need (a re-sent call), so the connection stays usable."""
    with contextlib.suppress(ClientDisconnect):
        async for _ in request.stream():
            pass


async def _read_direct(into: Any, n: int) -> tuple[Any, str | None] | None:
    """The body through ``into`` (``directbody.receive_into``): into a ``bytearray``, or onto a
    shared-memory file that is then mapped, as :func:`read_body` would have it; None when the
    protocol could not take it (then it comes through ``receive()``)."""
    if n <= shm.INLINE_MAX:
        view = memoryview(bytearray(n))
        return (view, None) if await into(directbody.MemorySink(view)) else None
    fd, path = tempfile.mkstemp(prefix=shm.ARG_PREFIX, dir=shm.shm_dir())
    try:
        if not await into(directbody.FileSink(fd, n)):
            os.unlink(path)
            return None
        return memoryview(mmap.mmap(fd, n)), path
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
