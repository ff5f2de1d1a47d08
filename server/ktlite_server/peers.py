"""The pod server's one HTTP client: every request a pod makes to another pod.

The coordinator streams every distributed call to every other pod; a general-purpose
async client costs more per request than the rest of the hop together. This one speaks
exactly what the pod server answers (a chunked frame stream, or a short fixed body) over
pooled asyncio connections: calls with a large body (:meth:`PeerPool.post`; the others go over
the pool's persistent peer links, ``linkclient``), cancels and ``/health`` polls
(:meth:`PeerPool.request`), and quorum probes (:meth:`PeerPool.ensure`). A peer at an
``https://`` address is reached over TLS pinned to the deployment's certificate (the pool's
``tls`` context: :mod:`ktlite_server.tls`); a pool without one refuses such a peer.

Errors: whatever fails underneath (``OSError``, asyncio's timeouts and short reads, a
malformed answer) is raised as a :class:`PeerError`, here and nowhere else::

    PeerError (ConnectionError)
    ├── PeerConnectError   the peer could not be connected to: nothing was sent
    └── PeerTimeout        the peer went silent (also a TimeoutError)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol
from urllib.parse import urlencode, urlsplit

from ktlite_server.hangups import hung_up, peer_closed
from ktlite_server.silence import QuietTimer
from ktlite_wire import pinning

WRITE_PIECE = 1 << 20  # a larger body is written this much at a time, each after a drain
PROBE_AFTER_S = 2.0  # a pooled connection older than this is probed before a call relies on it


class PeerError(ConnectionError):
    """The peer closed the connection or sent something that is not HTTP/1.1."""


class PeerConnectError(PeerError):
    """The peer could not be connected to (not started yet, or gone): safe to retry."""


class PeerTimeout(PeerError, TimeoutError):
    """The peer sent nothing for longer than the read timeout."""


class Link(Protocol):
    """A persistent link to a peer (``linkclient.PeerLink``): what the pool asks of it."""

    used: float  # when it last received anything (monotonic)
    transport: Any

    @property
    def open(self) -> bool: ...

    def closed(self) -> bool: ...

    def close(self) -> None: ...

    async def wait_closed(self, timeout: float = 5.0) -> None: ...


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = time.monotonic()  # when it last carried a response

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    def closed(self) -> bool:
        """The peer closed this connection, as far as the kernel knows: the loop learns of a
        peer's end (a killed pod's FIN or reset) only when it next reads the socket, which a
        call's quorum check can come before; a peek at the socket cannot."""
        if self.reader.at_eof() or self.writer.is_closing():
            return True
        return peer_closed(self.writer.get_extra_info("socket"))


class _Silence:
    """Aborts a connection whose peer stayed silent too long, and remembers that it did."""

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.expired = False

    def expire(self) -> None:
        self.expired = True
        self.conn.writer.transport.abort()


class PeerResponse:
    """A response being read; silence longer than ``read_timeout`` aborts the connection.

    One timer re-armed per chunk instead of a ``wait_for`` per read: a warm call's whole
    hop costs less than a handful of those.
    """

    def __init__(
        self,
        status: int,
        headers: dict[str, str],
        conn: _Conn,
        pool: PeerPool,
        key: str,
        read_timeout: float,
    ) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._pool = pool
        self._key = key
        self._timeout = read_timeout
        self._done = False
        self._timed_out = False
        self._quiet = QuietTimer(read_timeout, self._expire)
        self._arm = self._quiet.progress

    def _expire(self) -> None:
        self._timed_out = True
        self._conn.writer.transport.abort()

    def _lost(self, e: BaseException) -> Exception:
        if self._timed_out:
            return PeerTimeout(f"{self._key} sent nothing for {self._timeout:g}s")
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
                        if size < 0:
                            raise ValueError(size)
                    except ValueError:
                        raise PeerError(f"bad chunk size line {line[:40]!r}") from None
                    data = await r.readexactly(size + 2)
                    self._arm()
                    if size == 0:
                        break
                    yield data[:-2]
            else:
                try:
                    n = int(self.headers.get("content-length", "0"))
                except ValueError:
                    raise PeerError(f"{self._key} sent a bad content-length") from None
                if n:
                    yield await r.readexactly(n)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as e:
            raise self._lost(e) from e
        finally:
            self._quiet.stop()
        self._done = True

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    def release(self) -> None:
        if self._done and self.headers.get("connection", "").lower() != "close":
            self._conn.used = time.monotonic()
            self._pool._idle.setdefault(self._key, []).append(self._conn)
        else:
            self._conn.close()


async def _write_body(
    writer: asyncio.StreamWriter, pieces: list[memoryview], timeout: float, key: str
) -> None:
    """A large body, a piece of at most WRITE_PIECE at a time, each after the connection
    drained (a TLS transport encrypts what it is given at once: it holds one piece, not the
    body, and a slow peer holds up its own post only). A peer that takes no piece for
    ``timeout`` seconds is gone (one that stopped reading would hold the post forever)."""
    for piece in pieces:
        view = piece.cast("B")
        for pos in range(0, view.nbytes, WRITE_PIECE):
            writer.write(view[pos : pos + WRITE_PIECE])
            try:
                await asyncio.wait_for(writer.drain(), timeout)
            except asyncio.TimeoutError:
                writer.transport.abort()
                raise PeerTimeout(
                    f"{key} took no more of the body for {timeout:g}s ({pos} of "
                    f"{view.nbytes} bytes sent)"
                ) from None


def error_text(body: bytes) -> str:
    """What a pod's error answer says: its JSON ``detail`` where it has one, else the body's
    first 500 characters."""
    text = body.decode(errors="replace")[:500]
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(json.loads(text)["detail"])
    return text


@functools.lru_cache(maxsize=4096)  # the same few peers' URLs, on every request of every call
def _split(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    default = 443 if parts.scheme == "https" else 80
    return parts.hostname or "127.0.0.1", parts.port or default, parts.path


class PeerPool:
    """Keep-alive connections to the other pods; ``headers`` go with every request (the
    deployment's token: every pod of a deployment shares it); ``tls`` pins the deployment's
    certificate for peers at ``https://`` addresses."""

    def __init__(
        self, headers: Mapping[str, str] | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self._idle: dict[str, list[_Conn]] = {}
        self._headers = dict(headers or {})
        self._tls = tls
        # links to peers, by host:port, and the ones being opened (``linkclient``)
        self.links: dict[str, Link] = {}
        self.link_connects: dict[str, asyncio.Future[Any]] = {}

    @property
    def headers(self) -> dict[str, str]:
        """What goes with every request (the deployment's token): a link's opening request."""
        return dict(self._headers)

    @property
    def tls(self) -> ssl.SSLContext | None:
        return self._tls

    def __repr__(self) -> str:
        idle = sum(len(c) for c in self._idle.values())
        return f"PeerPool({idle} idle, {len(self.links)} links, headers=<hidden>)"

    async def _connect(self, host: str, port: int, timeout: float, https: bool) -> _Conn:
        if https and self._tls is None:
            raise PeerConnectError(
                f"{host}:{port} serves TLS, and this pod server was started without the "
                "deployment's certificate to pin; deploy again"
            )
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    host,
                    port,
                    limit=1 << 22,
                    ssl=self._tls if https else None,
                    server_hostname=pinning.SERVER_NAME if https else None,
                ),
                timeout,
            )
        except ssl.SSLCertVerificationError as e:  # not a retry case, but say what it is
            raise PeerConnectError(
                f"{host}:{port} presented a certificate that is not this deployment's ({e}); "
                "another process may hold that address"
            ) from e
        except (OSError, asyncio.TimeoutError) as e:
            raise PeerConnectError(f"cannot connect to {host}:{port}: {e!r}") from e
        return _Conn(reader, writer)

    @contextlib.asynccontextmanager
    async def post(
        self,
        url: str,
        path: str,
        headers: dict[str, str],
        body: memoryview | list[memoryview],
        connect_timeout: float = 5.0,
        read_timeout: float = 10.0,
    ) -> AsyncIterator[PeerResponse]:
        """POST ``body`` (in pieces, never joined) to ``url`` + ``path``; the response streams."""
        resp = await self._send("POST", url, path, headers, body, connect_timeout, read_timeout)
        try:
            yield resp
        finally:
            resp.release()

    async def request(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 5.0,
    ) -> tuple[int, bytes]:
        """A short request without a body (``url`` names the path): its status and whole body,
        all within ``timeout`` seconds."""
        _, _, path = _split(url)
        if params:
            path += "?" + urlencode(params)

        async def go() -> tuple[int, bytes]:
            resp = await self._send(
                method, url, path or "/", dict(headers or {}), memoryview(b""), timeout, timeout
            )
            try:
                return resp.status, await resp.read()
            finally:
                resp.release()

        try:
            return await asyncio.wait_for(go(), timeout)
        except asyncio.TimeoutError:
            raise PeerTimeout(f"{url} did not answer {method} within {timeout:g}s") from None

    async def get_json(self, url: str, timeout: float = 5.0) -> Any:
        """GET ``url``; its JSON body when it answers 200."""
        status, body = await self.request("GET", url, timeout=timeout)
        if status != 200:
            raise PeerError(f"{url} answered HTTP {status}: {body[:300].decode(errors='replace')}")
        try:
            return json.loads(body)
        except ValueError as e:
            raise PeerError(
                f"{url} answered with something that is not JSON: {body[:100]!r}"
            ) from e

    async def _send(
        self,
        method: str,
        url: str,
        path: str,
        headers: dict[str, str],
        body: memoryview | list[memoryview],
        connect_timeout: float,
        read_timeout: float,
    ) -> PeerResponse:
        host, port, _ = _split(url)
        https = url.startswith("https://")
        key = f"{host}:{port}"
        pieces = (
            body if isinstance(body, list) else [body]
        )  # a body in pieces is sent without joining
        length = sum(p.nbytes for p in pieces)
        request_head = [f"{method} {path} HTTP/1.1", f"host: {key}", f"content-length: {length}"]
        request_head += [f"{k}: {v}" for k, v in {**self._headers, **headers}.items()]
        request = ("\r\n".join(request_head) + "\r\n\r\n").encode("latin-1")
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            pooled = self._pooled(key)
            reused = pooled is not None
            conn = pooled or await self._connect(host, port, connect_timeout, https)
            # one timer that aborts the connection, not a wait_for (a task per request)
            silent = _Silence(conn)
            try:
                conn.writer.write(request)
                if length <= WRITE_PIECE:
                    for piece in pieces:
                        if piece.nbytes:
                            conn.writer.write(piece)
                    await conn.writer.drain()
                else:
                    await _write_body(conn.writer, pieces, read_timeout, key)
                timer = loop.call_later(read_timeout, silent.expire)
                try:
                    head = await conn.reader.readuntil(b"\r\n\r\n")
                finally:
                    timer.cancel()
            except (PeerError, ConnectionError, asyncio.IncompleteReadError) as e:
                conn.close()
                if silent.expired:
                    raise PeerTimeout(f"{key} sent no response for {read_timeout:g}s") from None
                if reused and attempt == 0:
                    # a stale keep-alive connection: nothing was processed. Retry once, on a
                    # new connection: the peer's other idle ones are as stale (a killed pod's
                    # end can still be on its way to each), and a second stale one would be
                    # taken for a call lost mid-way
                    for other in self._idle.pop(key, []):
                        other.close()
                    continue
                raise PeerError(f"{key}: {e!r}") from e
            except asyncio.LimitOverrunError as e:
                conn.close()
                raise PeerError(f"{key} sent oversized response headers") from e
            except BaseException:  # cancelled mid-request: the connection is in no known state
                conn.close()
                raise
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
        return PeerResponse(status, hdrs, conn, self, key, read_timeout)

    def _pooled(self, key: str) -> _Conn | None:
        """The most recently used idle connection to ``key`` that is still open: one the peer
        closed meanwhile (its keep-alive timeout, a restart) is dropped, not written to
        (uvloop raises on a write to a closed transport, asyncio's loop drops the bytes)."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed():
                return conn
            conn.close()
        return None

    def fresh(self, url: str, fresh_s: float = PROBE_AFTER_S) -> bool:
        """True when a pooled connection to ``url`` carried a response within ``fresh_s``
        seconds and is still open: :meth:`ensure` would return at once."""
        host, port, _ = _split(url)
        link = self.links.get(f"{host}:{port}")
        if link is not None and time.monotonic() - link.used < fresh_s and not link.closed():
            return True  # calls go over a link: it carried an answer within fresh_s
        idle = self._idle.get(f"{host}:{port}")
        if not idle:
            return False
        return time.monotonic() - idle[-1].used < fresh_s and not idle[-1].closed()

    def stale(self, urls: list[str], fresh_s: float = PROBE_AFTER_S) -> list[int]:
        """The indexes of the ``urls`` that :meth:`fresh` denies, the links to them asked
        whether their pods hung up with one ``poll`` (not a peek at each link)."""
        links: list[Any] = []
        for url in urls:
            host, port, _ = _split(url)
            link = self.links.get(f"{host}:{port}")
            ok = link is not None and time.monotonic() - link.used < fresh_s and link.open
            links.append(link.transport.get_extra_info("socket") if ok and link else None)
        gone = hung_up([s for s in links if s is not None])
        out, k = [], 0
        for i, (url, sock) in enumerate(zip(urls, links, strict=True)):
            if sock is None:
                if not self.fresh(url, fresh_s):
                    out.append(i)
                continue
            if gone[k]:
                out.append(i)
            k += 1
        return out

    async def ensure(self, url: str, timeout: float = 5.0, fresh_s: float = PROBE_AFTER_S) -> None:
        """Prove ``url`` answers: free when a pooled connection carried a response within
        ``fresh_s`` seconds (calls back to back), else a ``GET /health`` round trip (a
        stopped or hung peer keeps its TCP connections open, so a connection proves nothing).
        Raises PeerConnectError if the peer is unreachable or silent for ``timeout``."""
        host, port, _ = _split(url)
        idle = self._idle.setdefault(f"{host}:{port}", [])
        while idle and idle[-1].closed():
            idle.pop().close()  # the peer closed it (it exited, or restarted)
        if idle and time.monotonic() - idle[-1].used < fresh_s:
            return
        if self.fresh(url, fresh_s):  # a link carried an answer within fresh_s
            return
        try:
            await self.request("GET", url.rstrip("/") + "/health", timeout=timeout)
        except PeerTimeout:
            raise PeerConnectError(
                f"{host}:{port} accepted a connection but did not answer /health within "
                f"{timeout:g}s (stopped, or hung)"
            ) from None
        except PeerConnectError:
            raise
        except PeerError as e:
            raise PeerConnectError(f"{host}:{port} did not answer /health: {e}") from e

    async def aclose(self) -> None:
        links = list(self.links.values())
        self.links.clear()
        for link in links:
            link.close()
        idle = [c for conns in self._idle.values() for c in conns]
        self._idle.clear()
        for c in idle:
            c.close()

        async def closed(c: _Conn) -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.writer.wait_closed(), 5.0)

        await asyncio.gather(*(link.wait_closed() for link in links), *(closed(c) for c in idle))
