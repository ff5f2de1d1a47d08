"""A pod's end of a peer link to another pod (``linkframes``): calls sent to that pod over one
persistent connection, many at once, each answered as ``POST /call`` answers (a status, then a
frame stream), so the coordinator reads a link's answer as it reads an HTTP one
(:class:`LinkResponse` has ``PeerResponse``'s surface).

The link is opened with ``POST /link`` and the deployment's token (TLS pinned to the
deployment's certificate where the peer serves it: ``PeerPool``'s context). A link that breaks
fails every call still on it with a ``PeerError`` at once (the coordinator names the pod); the
next call opens a new link. A call whose pod sends nothing (no frame, no heartbeat) for its read
timeout fails alone with a ``PeerTimeout``, its stream closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ktlite_server.hangups import peer_closed
from ktlite_server.linkresponse import LinkResponse, LinkStream
from ktlite_server.peers import (
    PeerConnectError,
    PeerError,
    PeerPool,
)
from ktlite_server.silence import QuietTimer
from ktlite_wire import headers as wire_headers
from ktlite_wire import linkframes, pinning
from ktlite_wire.errors import ProtocolError

R = TypeVar("R", bound=LinkStream)
HEAD_MAX = 64 << 10  # the link's answer head (a 101, or an HTTP error answer)
# a call's body up to this size goes over the link; a larger one is an HTTP request of its own,
# which the member reads straight into shared memory (directbody)
BODY_MAX = 64 << 10
# the headers a call over a link carries (the token and version went with the link's request)
_LINK_HEADERS = frozenset(
    (
        wire_headers.TOKEN_HEADER,
        wire_headers.VERSION_HEADER,
        wire_headers.CALL_HEADER,
        "content-type",
    )
)


@functools.lru_cache(maxsize=4096)
def _address(url: str) -> tuple[str, int, bool]:
    parts = urlsplit(url)
    https = parts.scheme == "https"
    return parts.hostname or "127.0.0.1", parts.port or (443 if https else 80), https


def open_link(pool: PeerPool, url: str) -> PeerLink | None:
    """The pool's open link to the pod at ``url``; None when there is none (or it is closing,
    or the pod serves TLS and the pool has no context for it)."""
    host, port, https = _address(url)
    link = pool.links.get(f"{host}:{port}")
    if not isinstance(link, PeerLink) or not link.open or (https and pool.tls is None):
        return None
    return link


@contextlib.asynccontextmanager
async def post(
    pool: PeerPool,
    url: str,
    path: str,
    headers: dict[str, str],
    body: memoryview | list[memoryview],
    connect_timeout: float = 5.0,
    read_timeout: float = 10.0,
    run: bytes | None = None,
) -> AsyncIterator[LinkResponse | Any]:
    """``PeerPool.post``, over the pool's link to that pod when it is a call with a small
    body (opening the link when there is none): the answer reads the same either way. With
    ``run`` (``linkframes.run_fields``), a link sends the call as a ``RUN``: its answer's
    outcomes end up in ``done`` (or, large, in a frame stream)."""
    pieces = body if isinstance(body, list) else [body]
    host, port, https = _address(url)
    if (
        path != "/call"
        or sum(p.nbytes for p in pieces) > BODY_MAX
        or not _LINK_HEADERS.issuperset(headers)
        or (https and pool.tls is None)
    ):
        async with pool.post(url, path, headers, body, connect_timeout, read_timeout) as http:
            yield http
        return
    key = f"{host}:{port}"
    meta = headers[wire_headers.CALL_HEADER]
    for attempt in (0, 1):
        link = pool.links.get(key)
        reused = link is not None and link.open
        if not reused:
            try:
                link = await _connect(pool, key, host, port, https, connect_timeout)
            except LinkRefused as refused:  # read as the pod's answer to the call
                yield refused
                return
        assert isinstance(link, PeerLink)
        await link.drain()
        if run is None:
            resp = link.send(meta, pieces, read_timeout)
        else:
            resp = link.open_stream(lambda lk, n: LinkResponse(lk, n, read_timeout))
            link.transport.writelines(linkframes.run_message(resp.stream, run, pieces))
        try:
            await resp.until_head()
        except PeerError:
            resp.release()
            # the pod closed an idle link (it restarted; a RUN: it said GOAWAY before any
            # answer): nothing ran, send again
            if attempt == 0 and (link.goaway if run is not None else reused and link.lost):
                continue
            raise
        except BaseException:
            resp.release()
            raise
        break
    try:
        yield resp
    finally:
        resp.release()


async def _connect(
    pool: PeerPool, key: str, host: str, port: int, https: bool, timeout: float
) -> PeerLink:
    """The pool's new link to ``key``: one connection, however many calls ask at once."""
    pending = pool.link_connects.get(key)
    if pending is None:
        pending = asyncio.ensure_future(
            PeerLink.connect(host, port, pool.headers, pool.tls if https else None, timeout)
        )
        pool.link_connects[key] = pending

        def stored(done: asyncio.Future[PeerLink]) -> None:
            pool.link_connects.pop(key, None)
            if done.cancelled() or done.exception() is not None:
                return
            old = pool.links.get(key)
            if old is not None and old is not done.result():
                old.close()
            pool.links[key] = done.result()

        pending.add_done_callback(stored)
    return await asyncio.shield(pending)


class LinkRefused(PeerError):
    """The pod answered the link request with an HTTP answer (401, 409, ...), not ``101``."""

    def __init__(self, key: str, status: int, headers: dict[str, str], body: bytes) -> None:
        super().__init__(f"{key} refused a peer link: HTTP {status}")
        self.status = status
        self.headers = headers
        self.body = body

    async def iter_chunks(self) -> AsyncIterator[bytes]:  # PeerResponse's surface
        yield self.body

    async def read(self) -> bytes:
        return self.body


class PeerLink(asyncio.Protocol):
    """One link to the pod at ``key`` (``host:port``)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.used = time.monotonic()  # when it last received anything
        self.transport: Any = None
        self.lost = False
        self.goaway = False  # the pod said it closes the link (idle): no new call on it
        self._switched: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._head = bytearray()
        self._refusal: LinkRefused | None = None  # an HTTP answer to the link request, being read
        self._refusal_left = 0
        self._reader = linkframes.Reader()
        self._streams: dict[int, LinkStream] = {}
        self._watch: QuietTimer | None = None  # the silence of its RUNs' answers, for all
        self._next = 0
        self._paused = False
        self._drained: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"PeerLink({self.key}, {len(self._streams)} streams, lost={self.lost})"

    @property
    def open(self) -> bool:
        return (
            self._switched.done()
            and not self.lost
            and not self.goaway
            and not self.transport.is_closing()
        )

    @property
    def paused(self) -> bool:
        """The pod reads slower than this end writes: wait (``drain``) before sending more."""
        return self._paused

    def closed(self) -> bool:
        """Not open, or the pod's end of it is in the kernel and not read yet (a killed pod):
        what a call's quorum check asks before it relies on the link."""
        return not self.open or peer_closed(self.transport.get_extra_info("socket"))

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        headers: dict[str, str],
        tls: ssl.SSLContext | None,
        timeout: float,
    ) -> PeerLink:
        """A link to ``host:port``, its ``POST /link`` sent with ``headers`` (the token) and
        answered ``101``. A refused link (401, 409, ...) raises a PeerError with the pod's
        answer; no connection is a PeerConnectError."""
        key = f"{host}:{port}"
        loop = asyncio.get_running_loop()
        link = cls(key)
        head = [f"POST {linkframes.PATH} HTTP/1.1", f"host: {key}", "content-length: 0"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        try:
            await asyncio.wait_for(
                loop.create_connection(
                    lambda: link,
                    host,
                    port,
                    ssl=tls,
                    server_hostname=pinning.SERVER_NAME if tls is not None else None,
                ),
                timeout,
            )
        except ssl.SSLCertVerificationError as e:
            raise PeerConnectError(
                f"{key} presented a certificate that is not this deployment's ({e}); "
                "another process may hold that address"
            ) from e
        except (OSError, asyncio.TimeoutError) as e:
            raise PeerConnectError(f"cannot connect to {key}: {e!r}") from e
        link.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        try:
            await asyncio.wait_for(asyncio.shield(link._switched), timeout)
        except asyncio.TimeoutError:
            link.transport.abort()
            raise PeerConnectError(
                f"{key} accepted a connection but did not answer a link request within "
                f"{timeout:g}s (stopped, or hung)"
            ) from None
        except BaseException:
            link.transport.abort()
            raise
        return link

    def send(self, meta: str, body: list[memoryview], read_timeout: float) -> LinkResponse:
        """Send one call (its plan's header and body); its answer arrives on the response."""
        resp = self.open_stream(lambda link, n: LinkResponse(link, n, read_timeout))
        self.transport.writelines(linkframes.call_message(resp.stream, meta, body))
        return resp

    def stop(self, stop: linkframes.Stop) -> None:
        """Stop a call on the pod (``STOP``: what ``POST /cancel`` does there), unanswered: a
        pod that does not get it lost the link, which stops every call it brought."""
        self.transport.write(linkframes.stop_message(stop))

    def open_stream(self, make: Callable[[PeerLink, int], R]) -> R:
        """A new stream's response (``make(link, stream)``), whose message the caller writes
        next (a ``RUN``'s answer has no head: its first message, or GOAWAY, tells)."""
        if not self.open:
            raise PeerError(f"the link to {self.key} is closed")
        self._next = (self._next + 1) & 0xFFFFFFFF
        resp = self._streams[self._next] = make(self, self._next)
        if resp.watched_by_link:  # one timer for all of them, re-armed only when it fires
            if self._watch is None:
                self._watch = QuietTimer(resp._timeout, self._silent)
            self._watch.progress()
        return resp

    def _silent(self) -> None:
        """Nothing came for the streams the link watches for their read timeout: they fail
        (the pod sends each call it runs a heartbeat every HEARTBEAT_S)."""
        for resp in [r for r in self._streams.values() if r.watched_by_link]:
            resp.expire()

    async def drain(self) -> None:
        while self._paused and not self.lost:
            if self._drained is None:
                self._drained = asyncio.Event()
            await self._drained.wait()

    def close_stream(self, stream: int) -> None:
        if stream in self._streams and self.open:
            self.transport.write(linkframes.header(linkframes.CLOSE, stream, 0))

    def forget(self, stream: int) -> None:
        self._streams.pop(stream, None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self, timeout: float = 5.0) -> None:
        """Until the connection is closed (or ``timeout`` seconds passed)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._gone), timeout)

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    def data_received(self, data: bytes) -> None:
        self.used = time.monotonic()
        if self._watch is not None:
            self._watch.progress()
        if not self._switched.done():
            if self._refusal is not None:
                self._refusal_body(data)
                return
            data = self._handshake(data)
            if not data:
                return
        try:
            for kind, stream, payload in self._reader.feed(data):
                if (
                    kind == linkframes.GOAWAY
                ):  # the pod closes it: what it did not answer, never ran
                    self.goaway = True
                    continue
                resp = self._streams.get(stream)
                if resp is None:
                    continue  # a stream this end closed: what was under way is dropped
                if kind == linkframes.DATA:
                    resp.data(payload)
                elif kind == linkframes.HEAD:
                    resp.head(*linkframes.split_head(payload))
                elif kind == linkframes.END:
                    resp.end()
                elif kind == linkframes.DONE:
                    resp.finish(payload)
                else:
                    raise ProtocolError(f"a link message of kind {kind} from the pod's side")
        except ProtocolError as e:
            self._fail(PeerError(f"{self.key} sent a malformed link message: {e}"))
            self.transport.abort()

    def _handshake(self, data: bytes) -> bytes:
        """Read the answer to the link request; what follows it is the link's first bytes."""
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > HEAD_MAX:
                self._refused(PeerError(f"{self.key} answered a link request with no HTTP head"))
            return b""
        head, rest = bytes(self._head[: end + 4]), bytes(self._head[end + 4 :])
        self._head = bytearray()
        lines = head.decode("latin-1").split("\r\n")
        status = lines[0].split(" ")
        if len(status) >= 2 and status[1] == "101":
            self._switched.set_result(None)
            return rest
        # an HTTP answer (401 without the token, 409 for another version): the pod's own
        # answer, read by the coordinator as it reads a refused POST /call
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k:
                headers[k.strip().lower()] = v.strip()
        code = int(status[1]) if len(status) >= 2 and status[1].isdigit() else 0
        length = headers.get("content-length", "")
        self._refusal = LinkRefused(self.key, code, headers, b"")
        self._refusal_left = int(length) if length.isdigit() else HEAD_MAX
        self._refusal_body(rest)
        return b""

    def _refusal_body(self, data: bytes) -> None:
        """The body of an HTTP answer to the link request: the refusal is raised once it is
        whole (or the pod closed the connection)."""
        refusal = self._refusal
        if refusal is None:
            return
        take = data[: self._refusal_left]
        refusal.body += take
        self._refusal_left -= len(take)
        if self._refusal_left <= 0:
            self._refused(refusal)

    def _refused(self, error: PeerError) -> None:
        if not self._switched.done():
            self._switched.set_exception(error)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._watch is not None:
            self._watch.stop()
        if not self._gone.done():
            self._gone.set_result(None)
        self.resume_writing()
        error = PeerError(f"{self.key} closed the link mid-response: {exc!r}")
        if not self._switched.done():
            self._switched.set_exception(self._refusal or error)
            self._switched.exception()
        self._fail(error)

    def _fail(self, error: PeerError) -> None:
        for resp in list(self._streams.values()):
            resp.fail(error)
