"""Request bodies: read into memory (or a shared-memory file when large), or discarded."""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ktlite_server import directbody
from ktlite_server.refusal import refuse
from ktlite_wire import shm
from ktlite_wire.argfiles import ArgFile, ArgFiles
from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import LENGTH_HEADER


async def read_body(request: Request, limit: int) -> tuple[Any, str | None]:
    """Read the body into memory, or straight into a fresh shared-memory file when large
    (its path; the caller removes it)."""
    view, landed = await receive_body(request, limit, None)
    if landed is None:
        return view, None
    os.close(landed.fd)
    return view, landed.path


def body_length(request: Request, limit: int) -> int:
    """The request body's length (its Content-Length, or a proxy's LENGTH_HEADER); a refusal
    when it names none or one over ``limit``."""
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
    return n


async def receive_body(
    request: Request, limit: int, files: ArgFiles | None
) -> tuple[Any, ArgFile | None]:
    """Read the body into memory, or straight into a shared-memory file when large: one of
    ``files`` (a warm one when it has one free; given back by the caller), else a fresh one."""
    n = body_length(request, limit)
    into = request.scope.get("extensions", {}).get(directbody.BODY_INTO)
    if into is not None and n >= directbody.DIRECT_MIN and "content-length" in request.headers:
        # the server's protocol reads it past uvicorn's receive()
        direct = await _read_direct(functools.partial(into, request.scope, n), n, files)
        if direct is not None:
            return direct
    landed = None
    if n > shm.INLINE_MAX:
        landed = _take(files, n)
        buf: Any = mmap.mmap(landed.fd, n)
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
        if got != n:
            raise refuse(400, ErrorCode.BAD_REQUEST, f"body truncated: got {got} of {n} bytes")
    except BaseException:
        if landed is not None:
            view.release()
            buf.close()
            _give_back(files, landed)
        raise
    return view, landed


def _take(files: ArgFiles | None, n: int) -> ArgFile:
    if files is not None:
        return files.take(n)
    fd, path = shm.create(shm.ARG_PREFIX, n)
    return ArgFile(fd, path, n)


def _give_back(files: ArgFiles | None, landed: ArgFile) -> None:
    """A body that did not arrive whole: no rank saw its file."""
    if files is not None:
        files.give_back(landed, reusable=True)
    else:
        os.close(landed.fd)
        os.unlink(landed.path)


async def discard_body(request: Request) -> None:
    """Read a body this request does not need (a re-sent call), so the connection stays usable."""
    with contextlib.suppress(ClientDisconnect):
        async for _ in request.stream():
            pass


async def _read_direct(
    into: Any, n: int, files: ArgFiles | None
) -> tuple[Any, ArgFile | None] | None:
    """The body through ``into`` (``directbody.receive_into``): into a ``bytearray``, or onto a
    shared-memory file that is then mapped, as :func:`receive_body` would have it; None when
    the protocol could not take it (then it comes through ``receive()``)."""
    if n <= shm.INLINE_MAX:
        view = memoryview(bytearray(n))
        return (view, None) if await into(directbody.MemorySink(view)) else None
    landed = _take(files, n)
    sink = directbody.FileSink(landed.fd, n)
    try:
        if not await into(sink):
            _give_back(files, landed)
            return None
        return memoryview(mmap.mmap(landed.fd, n)), landed
    except BaseException:
        sink.close()  # cancelled while the body arrives: none of it lands in a file given back
        _give_back(files, landed)
        raise
