"""A small keep-alive HTTP/1.1 client for pod-to-pod calls on the hot path.

The coordinator streams every distributed call to every other pod; a general-purpose
async client costs more per request than the rest of the hop together. This one speaks
exactly what the pod server answers (a chunked frame stream, or a short fixed body) over
pooled asyncio connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

PROBE_AFTER_S = 2.0  # a pooled connection older than this is probed before a call relies on it


class PeerError(ConnectionError):
    """The peer closed the connection or sent something that is not HTTP/1.1."""


class PeerConnectError(PeerError):
    """The peer could not be connected to (not started yet, or gone): safe to retry."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = time.monotonic()  # when it last carried a response

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class PeerResponse:
    """A response being read; silence longer than ``read_timeout`` aborts the connection.

    One timer re-armed per chunk instead of a ``wait_for`` per read: a warm call's whole
    hop costs less than a handful of those.
    """

    def __init__(self, status: int, headers: dict[str, str], conn: _Conn, pool: PeerPool, key: str,
                 read_timeout: float) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._pool = pool
        self._key = key
        self._timeout = read_timeout
        self._done = False
        self._timed_out = False
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._last = loop.time()  # progress; the one timer checks it when it fires
        if self._timer is None:
            self._timer = loop.call_later(self._timeout, self._expire)

    def _expire(self) -> None:
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._last
        if idle < self._timeout:
            self._timer = loop.call_later(self._timeout - idle, self._expire)
            return
        self._timed_out = True
        self._conn.writer.transport.abort()

    def _lost(self, e: BaseException) -> Exception:
        if self._timed_out:
            return TimeoutError(f"{self._key} sent nothing for {self._timeout:g}s")
        return PeerError(f"{self._key} closed the connection mid-response: {e!r}")

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        r = self._conn.reader
        self._arm()
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    line = await r.readuntil(b"\r\n")
                    try:
                        size = int(line.split(b";")[0].strip(), 16)
                    except ValueError:
                        raise PeerError(f"bad chunk size line {line[:40]!r}") from None
                    data = await r.readexactly(size + 2)
                    self._arm()
                    if size == 0:
                        break
                    yield data[:-2]
            else:
                n = int(self.headers.get("content-length", "0"))
                if n:
                    yield await r.readexactly(n)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as e:
            raise self._lost(e) from e
        finally:
            if self._timer is not None:
                self._timer.cancel()
        self._done = True

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    def release(self) -> None:
        if self._done and self.headers.get("connection", "").lower() != "close":
            self._conn.used = time.monotonic()
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
    async def post(self, url: str, path: str, headers: dict[str, str], body: memoryview | list[memoryview],
                   connect_timeout: float = 5.0, read_timeout: float = 10.0) -> AsyncIterator[PeerResponse]:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        key = f"{host}:{port}"
        pieces = body if isinstance(body, list) else [body]  # a body in pieces is sent without joining
        length = sum(p.nbytes for p in pieces)
        head = [f"POST {path} HTTP/1.1", f"host: {key}", f"content-length: {length}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        for attempt in (0, 1):
            idle = self._idle.get(key)
            reused = bool(idle)
            conn = idle.pop() if idle else await self._connect(host, port, connect_timeout)
            try:
                conn.writer.write(request)
                for piece in pieces:
                    if piece.nbytes:
                        conn.writer.write(piece)
                await conn.writer.drain()
                head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), read_timeout)
            except (PeerError, ConnectionError, asyncio.IncompleteReadError) as e:
                conn.close()
                if reused and attempt == 0:
                    continue  # a stale keep-alive connection: nothing was processed, retry once
                raise PeerError(f"{key}: {e!r}") from e
            except asyncio.TimeoutError:
                conn.close()
                raise TimeoutError(f"{key} sent no response for {read_timeout:g}s") from None
            except asyncio.LimitOverrunError as e:
                conn.close()
                raise PeerError(f"{key} sent oversized response headers") from e
            break
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            conn.close()
            raise PeerError(f"{key} sent a bad status line {lines[0][:60]!r}") from None
        hdrs: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k:
                hdrs[k.strip().lower()] = v.strip()
        resp = PeerResponse(status, hdrs, conn, self, key, read_timeout)
        try:
            yield resp
        finally:
            resp.release()

    def fresh(self, url: str, fresh_s: float = PROBE_AFTER_S) -> bool:
        """True when a pooled connection to ``url`` carried a response within ``fresh_s``
        seconds and is still open: :meth:`ensure` would return at once."""
        parts = urlsplit(url)
        idle = self._idle.get(f"{parts.hostname or '127.0.0.1'}:{parts.port or 80}")
        return bool(idle) and time.monotonic() - idle[-1].used < fresh_s \
            and not (idle[-1].reader.at_eof() or idle[-1].writer.is_closing())

    async def ensure(self, url: str, timeout: float = 5.0, fresh_s: float = PROBE_AFTER_S) -> None:
        """Prove ``url`` answers: free when a pooled connection carried a response within
        ``fresh_s`` seconds (calls back to back), else a ``GET /health`` round trip (a
        stopped or hung peer keeps its TCP connections open, so a connection proves nothing).
        Raises PeerConnectError if the peer is unreachable or silent for ``timeout``."""
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        key = f"{host}:{port}"
        idle = self._idle.setdefault(key, [])
        while idle and (idle[-1].reader.at_eof() or idle[-1].writer.is_closing()):
            idle.pop().close()  # the peer closed it (it exited, or restarted)
        if idle and time.monotonic() - idle[-1].used < fresh_s:
            return
        conn = idle.pop() if idle else await self._connect(host, port, timeout)
        try:
            conn.writer.write(f"GET /health HTTP/1.1\r\nhost: {key}\r\n\r\n".encode("latin-1"))
            await conn.writer.drain()
            head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), timeout)
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await asyncio.wait_for(conn.reader.readexactly(length), timeout)
        except asyncio.TimeoutError:
            conn.close()
            raise PeerConnectError(f"{key} accepted a connection but did not answer /health within "
                                   f"{timeout:g}s (stopped, or hung)") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            conn.close()
            raise PeerConnectError(f"{key} did not answer /health: {e!r}") from e
        conn.used = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
