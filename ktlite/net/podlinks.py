"""Calls to pods reached directly over one persistent link per pod (``ktlite_wire.linkframes``),
every answer read on one thread: the way a submitted call leaves for a pod the caller reaches
itself (local and SSH backends, in-cluster callers; plain or pinned TLS).

A call over HTTP is a request head written and parsed, a response head, a connection taken from
and given back to the pool and registered with the reader: per call, on both ends. A link is the
pod-to-pod link of ``ktlite_server.linkclient``, opened from the caller: ``POST /link`` with the
deployment's token and protocol version (checked by the pod before anything else; TLS where
the deployment has it), answered ``101``; then each call is one ``CALL`` message on a stream
number of the link's, and its answer a ``HEAD``, ``DATA`` (the same frames a ``POST /call``
answers with) and ``END``. The pod runs it as every call (the same checks, frames, cancel and
"a call id runs at most once" rules). A call that needs no more than its id, its launch and
three flags (``linkframes.caller_run``: no timeout, per-rank items or shared-memory arguments)
is a binary ``RUN`` instead, which the pod runs on its lean path (``ktlite_server.callerrun``)
and answers with its ranks' outcomes in one binary ``DONE`` (log lines before it as ``DATA``).
Calls that end in one wake of the reader and start the next queued ones send them in one
write.

What fails, fails as over HTTP (the same ``done`` arguments as :class:`~ktlite.net.callmux.CallMux`'s):
a pod that refuses the link (401, 409) refuses each call waiting for it with its answer; a pod
that cannot be connected to is ``ConnectionRefused`` (nothing was sent); a link that breaks
fails every call on it with ``ConnectionFailed`` naming the pod, and the next call opens a new
link; a call whose pod sends nothing for the silence timeout fails alone (``TimeoutError``) and
its stream is closed (the pod abandons it). A call sent on a link that had no other call, which
the pod then closed before any byte came back, is sent again on a new link, as the pool sends a
request again on a keep-alive connection the pod had closed while it was idle.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from ktlite.net.connection import Connection, ConnectionFailed, ConnectionRefused, pod_address
from ktlite.net.readerthread import ReaderThread
from ktlite_wire import landing, linkframes
from ktlite_wire.errors import ProtocolError
from ktlite_wire.frames import FrameParser
from ktlite_wire.headers import ERROR_CODE_HEADER, TOKEN_HEADER

logger = logging.getLogger(__name__)

BODY_MAX = 64 << 10  # a larger call body is an HTTP request of its own (the pod's limit too)
READ = 1 << 18  # bytes read at once
Done = Callable[[int, dict[str, str], Any, BaseException | None], None]
# (status, headers, frames or the refusal's body, error): the answer, once whole
Key = tuple[str, int, "ssl.SSLContext | None", str]  # address, pinning context, token


class _Call:
    """A call on a link: what it sends, its sinks, and how far its answer came."""

    __slots__ = (
        "message",
        "on_frame",
        "on_done",
        "done",
        "silence",
        "deadline",
        "frames",
        "status",
        "code",
        "refusal",
        "again",
        "heard_at",
    )

    def __init__(
        self,
        meta: str | bytes,
        parts: list[Any],
        on_frame: Any,
        on_done: Callable[[memoryview], None] | None,
        done: Done,
        silence: float,
    ) -> None:
        self.message = (meta, [memoryview(p) for p in parts])
        self.on_frame = on_frame
        self.on_done = on_done
        self.done = done
        self.silence = silence
        self.deadline = 0.0
        self.frames = FrameParser(landing.caller())
        self.status = 0
        self.code = ""
        self.refusal = b""
        self.again = False  # sent on an idle link: sent again if the pod had closed it
        self.heard_at = 0  # the link's reads when it was sent


class _Link:
    """One open link to a pod: its socket and the calls on it, by stream number."""

    def __init__(self, key: Key, conn: Connection, headers: dict[str, str]) -> None:
        self.key = key
        self.conn = conn
        self.sock = sock = conn.sock
        self.headers = headers  # the link request's: a new link after this one takes them again
        self.fd = sock.fileno()
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.lock = threading.Lock()  # one writer at a time; over TLS, every read too
        self.reader = linkframes.Reader()
        self.calls: dict[int, _Call] = {}
        self.next = 0
        self.reads = 0  # reads that brought bytes
        self.lost = False

    def __repr__(self) -> str:
        return f"_Link({self.where}, {len(self.calls)} calls, lost={self.lost})"

    @property
    def where(self) -> str:
        return f"{self.key[0]}:{self.key[1]}"

    def write(self, data: bytes, timeout: float = 30.0) -> None:
        """All of ``data`` (the socket is non-blocking: the reader's); OSError when the link
        broke or took no byte for ``timeout`` seconds."""
        view = memoryview(data)
        with self.lock:
            while view.nbytes:
                try:
                    n = self.sock.send(view)
                except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    n = 0
                view = view[n:]
                if view.nbytes and not n:
                    _, ready, _ = select.select([], [self.sock], [], timeout)
                    if not ready:
                        raise TimeoutError(f"{self.where} took no byte of a call for {timeout:g}s")

    def recv(self) -> tuple[bytes | None, bool]:
        """What came (b"" when the pod closed the link; None when nothing is there), and
        whether TLS holds more of it decrypted."""
        try:
            if self.tls:
                with self.lock:
                    data = self.sock.recv(READ)
                    return data, self.sock.pending() > 0  # type: ignore[attr-defined]
            return self.sock.recv(READ), False
        except (BlockingIOError, ssl.SSLWantReadError):
            return None, False

    def close(self) -> None:
        self.conn.close()


class LinkMux(ReaderThread):
    """The caller's links to its pods, one per pod address and token, and the one thread that
    reads them (``epoll``); safe to start calls from any thread."""

    thread_name = "ktlite-links"
    what = "the links to pods"

    def __init__(self) -> None:
        super().__init__()
        self._links: dict[Key, _Link] = {}
        self._opening: dict[Key, list[_Call]] = {}  # calls waiting for their link to open
        self._fds: dict[int, _Link] = {}
        self._ended: list[tuple[Done, tuple[Any, ...]]] = []  # the reader's thread's only
        self._batch: dict[_Link, list[Any]] = {}  # calls the reader's thread started this turn
        self._scan_at = 0.0  # when the calls' deadlines are next looked at (_expire)

    def _forget_all(self) -> None:
        """In a forked child: the parent's links and reader are not this process's (its
        sockets are closed here only; the parent keeps them), its next call opens its own."""
        for link in list(self._fds.values()):
            link.close()
        self._links, self._opening, self._fds, self._batch = {}, {}, {}, {}
        self._ended = []

    def start(
        self,
        url: str,
        headers: dict[str, str],
        meta: str | bytes,
        parts: list[Any],
        context: ssl.SSLContext | None,
        silence: float,
        on_frame: Callable[[int, Any], None],
        done: Done,
        connect_timeout: float = 10.0,
        on_done: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Send a call over the link to the pod at ``url``, opened with ``headers`` (the token
        and version) when there is none: a ``CALL`` of its plan's header ``meta`` and body
        ``parts``, or, where ``meta`` is a ``RUN``'s fields (bytes: ``linkframes.caller_run``),
        that ``RUN``. ``on_frame(kind, payload)`` for each frame of its answer as it comes,
        ``on_done(payload)`` for a ``RUN``'s ``DONE``, then ``done`` once."""
        key: Key = (*pod_address(url), context, headers.get(TOKEN_HEADER, ""))
        call = _Call(meta, parts, on_frame, on_done, done, silence)
        self._go(key, headers, call, connect_timeout)

    def _go(self, key: Key, headers: dict[str, str], call: _Call, connect_timeout: float) -> None:
        with self._lock:
            link = self._links.get(key)
            if link is None:
                waiting = self._opening.get(key)
                if waiting is not None:  # another call opens it: this one leaves with it
                    waiting.append(call)
                    return
                self._opening[key] = [call]
        if link is not None:
            self._send(link, [call])
            return
        if self._on_reader():
            # a connect may take its whole timeout: never on the thread that reads the answers
            threading.Thread(
                target=self._open,
                args=(key, headers, connect_timeout),
                name="ktlite-link-connect",
                daemon=True,
            ).start()
            return
        self._open(key, headers, connect_timeout)

    def _open(self, key: Key, headers: dict[str, str], timeout: float) -> None:
        """Open the link to ``key`` and send the calls that wait for it (or end each with the
        pod's refusal, or the connection's failure)."""
        link: _Link | None = None
        answer: tuple[int, dict[str, str], bytes] | None = None
        error: BaseException | None = None
        try:
            link, answer = _connect(key, headers, timeout)
        except Exception as e:  # noqa: BLE001 - every call that waits for the link hears it
            error = e
        epoll = self._running()
        with self._lock:
            calls = self._opening.pop(key, [])
            if link is not None:
                self._links[key] = link
                self._fds[link.fd] = link
                epoll.register(link.fd, select.EPOLLIN | select.EPOLLRDHUP)
        if link is not None:
            self._send(link, calls)
            return
        for call in calls:  # nothing of them was sent
            if answer is not None:
                status, hdrs, body = answer
                call.done(status, hdrs, body, None)
            else:
                call.done(0, {}, None, error)

    def _send(self, link: _Link, calls: list[_Call]) -> None:
        out: list[Any] = []
        now = time.monotonic()
        with link.lock:
            lost = link.lost
            idle = not link.calls and link.reads > 0
            for call in [] if lost else calls:
                link.next = link.next % 0xFFFFFFFF + 1
                call.again, call.heard_at = idle, link.reads
                call.deadline = now + call.silence
                link.calls[link.next] = call
                meta, body = call.message
                if type(meta) is bytes:
                    out += linkframes.run_message(link.next, meta, body)
                else:
                    out += linkframes.call_message(link.next, str(meta), body)
        if lost:  # it broke meanwhile: nothing of these was sent, they go on a new one
            for call in calls:
                self._go(link.key, link.headers, call, 10.0)
            return
        if self._on_reader():  # leaves with the turn's other calls
            self._batch.setdefault(link, []).extend(out)
            return
        try:
            link.write(b"".join(out))
        except OSError as e:  # the reader learns it from the socket and fails its calls
            logger.debug("a call to %s could not be sent: %r", link.where, e)
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)

    def _fail_all(self, error: Exception) -> None:
        for link in list(self._fds.values()):
            self._lose(link, ConnectionFailed(f"the caller's link reader failed: {error!r}"))
        self._finish()

    def _turn(self) -> None:
        """One wait: what came is read, silent calls fail, ended calls end, and the calls their
        ends started leave."""
        try:
            events = self._epoll.poll(max(0.0, min(self._scan_at - time.monotonic(), 1.0)))
        except InterruptedError:
            return
        for fd, _ in events:
            link = self._fds.get(fd)
            if link is not None:
                self._read(link)
        now = time.monotonic()
        if now >= self._scan_at:  # not every turn: the calls' deadlines at most once a second
            self._scan_at = self._expire(now)
        while True:  # until no ended call started another
            self._finish()
            batch, self._batch = self._batch, {}
            if not batch:
                return
            for link, out in batch.items():
                try:
                    link.write(b"".join(out))
                except OSError as e:
                    self._lose(link, ConnectionFailed(f"{link.where}: {e!r}"))

    def _expire(self, now: float) -> float:
        """Fail the calls silent past their deadline (their streams closed); the earliest
        deadline of the others, at most a second from now (a call started before then has a
        later one: its silence timeout is longer than that)."""
        earliest = now + 1.0
        for link in list(self._fds.values()):
            for stream, call in list(link.calls.items()):
                if call.deadline < now and not link.lost:
                    self._close(
                        link,
                        stream,
                        call,
                        TimeoutError(f"no frame and no heartbeat for {call.silence:g}s"),
                    )
                elif call.deadline < earliest:
                    earliest = call.deadline
        return earliest

    def _finish(self) -> None:
        ended, self._ended = self._ended, []
        for done, args in ended:
            try:
                done(*args)
            except BaseException:  # noqa: BLE001 - never the reader's thread
                logger.exception("a call's completion failed")

    def _read(self, link: _Link) -> None:
        try:
            while True:
                data, more = link.recv()
                if data is None:
                    return
                if not data:
                    raise ConnectionFailed(f"{link.where} closed the link")
                link.reads += 1
                self._messages(link, data)
                if len(data) < READ and not more:
                    return  # all there was (epoll says when more comes)
        except (ConnectionFailed, ProtocolError) as e:
            self._lose(link, e)
        except OSError as e:  # a reset connection
            self._lose(link, ConnectionFailed(f"{link.where}: {e!r}"))

    def _messages(self, link: _Link, data: bytes) -> None:
        now = time.monotonic()
        for kind, stream, payload in link.reader.feed(data):
            call = link.calls.get(stream)
            if call is None:
                continue  # a stream this end closed: what was under way is dropped
            call.deadline = now + call.silence
            if kind == linkframes.DATA:
                try:
                    for frame, body in call.frames.feed(payload):
                        call.on_frame(frame, body)
                except BaseException as e:  # noqa: BLE001 - a sink's error ends its own call only
                    self._close(link, stream, call, e)
            elif kind == linkframes.HEAD:
                call.status, call.code, call.refusal = linkframes.split_head(payload)
                if call.status != 200:  # a refusal: its whole answer
                    self._end(link, stream, call, None)
            elif kind == linkframes.DONE and call.on_done is not None:
                try:
                    call.on_done(payload)
                except ProtocolError as e:  # this call's answer only: the link reads on
                    self._end(link, stream, call, e)
                else:
                    self._end(link, stream, call, None)
            elif kind == linkframes.END:
                error = (
                    ProtocolError("stream ended inside a frame") if call.frames.mid_frame else None
                )
                self._end(link, stream, call, error)
            else:
                raise ProtocolError(f"a link message of kind {kind} from the pod's side")

    def _close(self, link: _Link, stream: int, call: _Call, error: BaseException) -> None:
        """End a call that goes on at the pod: its stream is closed (the pod abandons it)."""
        self._end(link, stream, call, error)
        self._batch.setdefault(link, []).append(linkframes.header(linkframes.CLOSE, stream, 0))

    def _end(self, link: _Link, stream: int, call: _Call, error: BaseException | None) -> None:
        link.calls.pop(stream, None)
        headers = {ERROR_CODE_HEADER: call.code} if call.code else {}
        body = call.refusal if call.status >= 400 else None
        self._ended.append((call.done, (call.status, headers, body, error)))

    def _lose(self, link: _Link, error: BaseException) -> None:
        """The link broke: its calls fail (or go again on a new link: see the module
        docstring), and the next call opens a new one."""
        with self._lock:
            if self._links.get(link.key) is link:
                del self._links[link.key]
            self._fds.pop(link.fd, None)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(link.fd)
        link.close()
        self._batch.pop(link, None)
        with link.lock:
            link.lost = True
            calls, link.calls = link.calls, {}
        again = [c for c in calls.values() if c.again and c.heard_at == link.reads]
        for stream, call in calls.items():
            if call in again:
                continue
            if call.frames.mid_frame:
                error = ConnectionFailed(
                    f"{error} after {call.frames.where()}: the frame, and the value in it, are "
                    "lost (the pod's log says why)"
                )
            self._end(link, stream, call, error)
        for call in again:  # the pod had closed the idle link: nothing of these ran
            threading.Thread(
                target=self._go, args=(link.key, link.headers, call, 10.0), daemon=True
            ).start()

    def drop(self, url: str) -> None:
        """Close the links to the pod at ``url`` (it is gone); calls on them fail."""
        address = pod_address(url)
        with self._lock:
            links = [k for key, k in self._links.items() if key[:2] == address]
        for link in links:
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)


def _connect(
    key: Key, headers: dict[str, str], timeout: float
) -> tuple[_Link | None, tuple[int, dict[str, str], bytes] | None]:
    """A new link to ``key`` (and None), or the pod's HTTP answer to the link request (a 401,
    a 409: read as its answer to each call); ConnectionRefused when no link request was sent,
    ConnectionFailed when one was and no answer came."""
    host, port, context = key[0], key[1], key[2]
    conn = Connection(host, port, timeout, context)  # ConnectionRefused: nothing was sent
    # heads=late: a call's 200 head comes with its first frames (one wake of the reader, not
    # two); nothing here relies on it to know whether a call reached the pod
    path = f"{linkframes.PATH}?heads=late"
    head = [f"POST {path} HTTP/1.1", f"host: {host}:{port}", "content-length: 0"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    try:
        conn.send(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"), [], timeout)
        # the pod writes nothing after its 101 until a call comes: the head is all there is
        status, hdrs = conn.response(timeout)
        if status != 101:
            body = b"".join(conn.body(hdrs))
            conn.close()
            return None, (status, hdrs, body)
    except TimeoutError as e:
        conn.close()
        raise ConnectionRefused(
            f"{host}:{port} accepted a connection but did not answer a link request within "
            f"{timeout:g}s (stopped, or hung)"
        ) from e
    except (ConnectionFailed, OSError) as e:
        conn.close()
        raise ConnectionRefused(
            f"{host}:{port} closed the connection at a link request: {e!r}"
        ) from e
    conn.sock.setblocking(False)
    return _Link(key, conn, headers), None
