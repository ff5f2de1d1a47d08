"""A small keep-alive HTTP/1.1 client for pod-to-pod calls on the hot path.

The coordinator streams every distributed call to every other pod; a general-purpose
async client costs more per request than the rest of the hop together. This one speaks
exactly what the pod server answers (a chunked frame stream, or a short fixed body) over
pooled asyncio connections.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class PeerError(ConnectionError):
    """The peer closed the connection or sent something that is not HTTP/1.1."""


class PeerConnectError(PeerError):
    """The peer could not be connected to (not started yet, or gone): safe to retry."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class PeerResponse:
    def __init__(self, status: int, headers: dict[str, str], conn: _Conn, pool: PeerPool, key: str,
                 read_timeout: float) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._pool = pool
        self._key = key
        self._timeout = read_timeout
        self._done = False

    async def _read(self, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self._timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"peer sent nothing for {self._timeout:g}s") from None
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise PeerError(f"peer closed the connection mid-response: {e!r}") from e

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        r = self._conn.reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line = await self._read(r.readline())
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise PeerError(f"bad chunk size line {line[:40]!r}") from None
                if size == 0:
                    await self._read(r.readline())
                    break
                data = await self._read(r.readexactly(size))
                await self._read(r.readexactly(2))
                yield data
        else:
            n = int(self.headers.get("content-length", "0"))
            if n:
                yield await self._read(r.readexactly(n))
        self._done = True

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    def release(self) -> None:
        if self._done and self.headers.get("connection", "").lower() != "close":
            self._pool._idle.setdefault(self._key, []).append(self._conn)
        else:
            self._conn.close()


class PeerPool:
    def __init__(self) -> None:
        self._idle: dict[str, list[_Conn]] = {}

    async def _connect(self, host: str, port: int, timeout: float) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 22), timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise PeerConnectError(f"cannot connect to {host}:{port}: {e!r}") from e
        return _Conn(reader, writer)

    @contextlib.asynccontextmanager
    async def post(self, url: str, path: str, headers: dict[str, str], body: memoryview,
                   connect_timeout: float = 5.0, read_timeout: float = 10.0) -> AsyncIterator[PeerResponse]:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        key = f"{host}:{port}"
        head = [f"POST {path} HTTP/1.1", f"host: {key}", f"content-length: {body.nbytes}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        for attempt in (0, 1):
            idle = self._idle.get(key)
            reused = bool(idle)
            conn = idle.pop() if idle else await self._connect(host, port, connect_timeout)
            try:
                conn.writer.write(request)
                if body.nbytes:
                    conn.writer.write(body)
                await conn.writer.drain()
                status_line = await asyncio.wait_for(conn.reader.readline(), read_timeout)
                if not status_line:
                    raise PeerError("connection closed before the response")
            except (PeerError, ConnectionError, asyncio.IncompleteReadError) as e:
                conn.close()
                if reused and attempt == 0:
                    continue  # a stale keep-alive connection: nothing was processed, retry once
                raise PeerError(f"{key}: {e!r}") from e
            except asyncio.TimeoutError:
                conn.close()
                raise TimeoutError(f"{key} sent no response for {read_timeout:g}s") from None
            break
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            conn.close()
            raise PeerError(f"{key} sent a bad status line {status_line[:60]!r}") from None
        hdrs: dict[str, str] = {}
        while True:
            line = await asyncio.wait_for(conn.reader.readline(), read_timeout)
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            hdrs[k.strip().lower()] = v.strip()
        resp = PeerResponse(status, hdrs, conn, self, key, read_timeout)
        try:
            yield resp
        finally:
            resp.release()

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
