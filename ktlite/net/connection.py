"""A lean keep-alive HTTP/1.1 connection for the call hot path to pods reached directly.

A warm call is a few hundred microseconds of server work; a general HTTP client's
per-request machinery costs as much again. Calls to pods reached directly (local and SSH
backends, in-cluster) go through this, plain (``http://``) or over TLS pinned to the
deployment's certificate (``https://``, with the context :mod:`ktlite.net.tls` makes); anything
behind a proxy that needs its own credentials (the Kubernetes API proxy) goes through the
injectable ``httpx`` client instead.
"""

from __future__ import annotations

import contextlib
import functools
import io
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import urlsplit

from ktlite.net.progress import Progress
from ktlite_wire import landing, pinning
from ktlite_wire.errors import ProtocolError
from ktlite_wire.frames import FrameParser

PIECE = 1 << 20  # the most bytes read at once from a response body
PROGRESS_BYTES = 64 << 20  # a body at least this large is sent in slices, with a bar
SLICE_BYTES = 16 << 20


class ConnectionFailed(ConnectionError):
    """The pod could not be connected to, or closed the connection mid-response."""


class ConnectionRefused(ConnectionFailed):
    """No connection could be opened to the pod (nothing was sent)."""


class CertificateRefused(ConnectionRefused):
    """The pod's TLS certificate is not the deployment's pinned one (nothing was sent)."""


Key = tuple[str, int, "ssl.SSLContext | None"]  # a pod's address, and the context that pins it


class Connection:
    def __init__(
        self, host: str, port: int, connect_timeout: float, context: ssl.SSLContext | None = None
    ) -> None:
        self.key: Key = (host, port, context)
        try:
            raw = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as e:
            raise ConnectionRefused(f"cannot connect to {host}:{port}: {e!r}") from e
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = raw if context is None else _handshake(raw, host, port, context)
        self.reader = cast(io.BufferedReader, self.sock.makefile("rb", buffering=1 << 16))
        self.reusable = False
        self.nonblocking = False  # left so by callmux; a blocking send sets a timeout first
        self.lowat = 1  # SO_RCVLOWAT: callmux's connections wake it only from a whole head on

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.close()
            self.sock.close()

    def send(self, head: bytes, parts: list[Any], timeout: float = 10.0) -> None:
        size = sum(memoryview(p).nbytes for p in parts)
        if size <= 1 << 16 and self.nonblocking:  # callmux's: one send, unless the buffer is full
            data = head + b"".join(parts)
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            head, parts, size = data[sent:], [], 0
        if self.nonblocking:
            self.sock.settimeout(timeout)
            self.nonblocking = False
        if size <= 1 << 16:  # one segment for the usual tiny call
            self.sock.sendall(head + b"".join(parts))
            return
        self.sock.sendall(head)
        if size < PROGRESS_BYTES:
            for p in parts:
                self.sock.sendall(memoryview(p).cast("B"))
            return
        # a large body (a GiB argument takes seconds): a bar once it has lasted a second
        bar = Progress(f"sending to {self.key[0]}:{self.key[1]}", size, delay_s=1.0)
        for p in parts:
            view = memoryview(p).cast("B")
            for i in range(0, view.nbytes, SLICE_BYTES):
                piece = view[i : i + SLICE_BYTES]
                self.sock.sendall(piece)
                bar.add(piece.nbytes)
        bar.close()

    def _line(self) -> bytes:
        line = self.reader.readline(1 << 16)
        if not line:
            raise ConnectionFailed("the pod closed the connection")
        return line

    def response(self, read_timeout: float) -> tuple[int, dict[str, str]]:
        self.sock.settimeout(read_timeout)
        self.nonblocking = False
        if self.lowat > 1:  # left by callmux: a blocking read returns whatever came
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            self.lowat = 1
        status_line = self._line()
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            raise ConnectionFailed(f"bad status line {status_line[:60]!r}") from None
        headers: dict[str, str] = {}
        while True:
            line = self._line()
            if line in (b"\r\n", b"\n"):
                return status, headers
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()

    def body(self, headers: dict[str, str]) -> Iterator[bytes]:
        """The response body in pieces of at most :data:`PIECE` bytes (a chunk or length the
        pod claims allocates nothing before its bytes arrive); the connection is reusable
        once this is exhausted."""
        yield from self._pieces(headers, None)  # type: ignore[misc]  # no parser: all bytes

    def frames(self, headers: dict[str, str]) -> Iterator[tuple[int, Any]]:
        """The response body's frames (``ktlite_wire.frames``); a large frame's payload is
        read from the socket straight into its own memory (``FrameParser.room``), not
        through pieces that are copied on. Raises ProtocolError when the body ends mid-frame."""
        parser = FrameParser(landing.caller())  # warm memory, where a payload was let go
        try:
            for got in self._pieces(headers, parser):
                yield from got if isinstance(got, list) else parser.feed(got)
        except ConnectionFailed as e:
            if not parser.mid_frame:
                raise
            # a pod cuts a response off mid-frame when the value it was sending is lost (its
            # rank died writing it): never a value, whole or not
            raise ConnectionFailed(
                f"{e} after {parser.where()}: the frame, and the value in it, are lost "
                "(the pod's log says why)"
            ) from e
        if parser.mid_frame:
            raise ProtocolError("stream ended inside a frame")

    def _pieces(
        self, headers: dict[str, str], parser: FrameParser | None
    ) -> Iterator[bytes | list[tuple[int, Any]]]:
        """The body's bytes, in pieces; with ``parser``, the frames of the bytes it read into
        the parser's room itself (a list) among them."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                try:
                    size = int(self._line().split(b";")[0].strip(), 16)
                except ValueError:
                    raise ConnectionFailed("bad chunk size line") from None
                if size == 0:
                    self._line()
                    break
                if size < PIECE:  # the usual small chunk (a frame of logs, a result): one read
                    data = self.reader.read(size + 2)
                    if len(data) != size + 2:
                        raise ConnectionFailed("the pod closed the connection mid-chunk")
                    yield data[:-2]
                    continue
                yield from self._exactly(size, "mid-chunk", parser)
                if self.reader.read(2) != b"\r\n":
                    raise ConnectionFailed("the pod sent a chunk longer than its size line")
        else:
            yield from self._exactly(int(headers.get("content-length", "0")), "mid-body", parser)
        self.reusable = headers.get("connection", "").lower() != "close"

    def _exactly(
        self, n: int, where: str, parser: FrameParser | None = None
    ) -> Iterator[bytes | list[tuple[int, Any]]]:
        while n > 0:
            if parser is not None and (room := parser.room()) is not None:
                # a large payload: read into its memory
                k = self.reader.readinto(room[: min(n, room.nbytes)])
                if not k:
                    raise ConnectionFailed(f"the pod closed the connection {where}")
                n -= k
                yield parser.filled(k)
                continue
            data = self.reader.read(min(n, PIECE, parser.due() if parser else PIECE))
            if not data:
                raise ConnectionFailed(f"the pod closed the connection {where}")
            n -= len(data)
            yield data


def _handshake(raw: socket.socket, host: str, port: int, context: ssl.SSLContext) -> socket.socket:
    """``raw`` wrapped in TLS with ``context`` (the handshake within the socket's connect
    timeout); a certificate that is not the pinned one is a CertificateRefused."""
    try:
        return context.wrap_socket(raw, server_hostname=pinning.SERVER_NAME)
    except ssl.SSLCertVerificationError as e:
        raw.close()
        raise CertificateRefused(pinning.refusal(host, port, context, e)) from e
    except TimeoutError as e:
        raw.close()
        raise ConnectionRefused(
            f"{host}:{port} accepted a connection but did not complete a TLS handshake within "
            f"{raw.gettimeout()}s (stopped, or hung)"
        ) from e
    except OSError as e:  # ssl.SSLError too: e.g. a plain-HTTP server answering the handshake
        raw.close()
        raise ConnectionRefused(
            f"no TLS connection to {host}:{port} ({e!r}); the pod may serve plain HTTP "
            "(a server started without TLS): deploy it again"
        ) from e


class Pool:
    """Idle connections per pod address (and pinning context); safe to share between
    threads."""

    def __init__(self) -> None:
        self._idle: dict[Key, list[Connection]] = {}
        self._lock = threading.Lock()

    def forget_inherited(self) -> None:
        """In a forked child: the idle connections are the parent's too (one socket written
        by two processes would mix their requests); close this process's copies of them."""
        idle, self._idle, self._lock = self._idle, {}, threading.Lock()
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def has_idle(self, key: Key) -> bool:
        """Whether an idle connection to ``key`` waits (:meth:`take` would not connect)."""
        return bool(self._idle.get(key))

    def take(
        self, key: Key, connect_timeout: float, fresh: bool = False
    ) -> tuple[Connection, bool]:
        """An idle connection to ``key`` (and True), else (or with ``fresh``) a new one."""
        if not fresh:
            with self._lock:
                idle = self._idle.get(key)
                if idle:
                    return idle.pop(), True
        return Connection(key[0], key[1], connect_timeout, key[2]), False

    def release(self, conn: Connection) -> None:
        if not conn.reusable:
            conn.close()
            return
        conn.reusable = False
        with self._lock:
            self._idle.setdefault(conn.key, []).append(conn)

    def post(
        self,
        url: str,
        path: str,
        headers: dict[str, str],
        parts: list[Any],
        connect_timeout: float,
        read_timeout: float,
        context: ssl.SSLContext | None = None,
    ) -> tuple[Connection, int, dict[str, str]]:
        """Send a POST and read the response head; the caller reads ``conn.body`` and then
        ``release``s (or closes) the connection. ``context``: TLS pinned to the pod's
        certificate, for an ``https://`` pod."""
        return self.request(
            "POST", url, path, headers, parts, connect_timeout, read_timeout, context
        )

    def request(
        self,
        method: str,
        url: str,
        path: str,
        headers: dict[str, str],
        parts: list[Any],
        connect_timeout: float,
        read_timeout: float,
        context: ssl.SSLContext | None = None,
    ) -> tuple[Connection, int, dict[str, str]]:
        """Send a request (``path`` with its query) and read the response head."""
        key, head = self.prepare(method, url, path, headers, parts, context)
        host, port = key[0], key[1]
        for attempt in (0, 1):
            conn, reused = self.take(key, connect_timeout)  # ConnectionRefused passes through
            try:
                conn.send(head, parts)
                status, hdrs = conn.response(read_timeout)
                return conn, status, hdrs
            except TimeoutError:
                conn.close()
                raise
            except (ConnectionFailed, ConnectionError) as e:
                conn.close()
                if reused and attempt == 0:
                    continue  # an idle connection the pod had closed: nothing was processed
                raise ConnectionFailed(f"{host}:{port}: {e}") from e
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    @staticmethod
    def prepare(
        method: str,
        url: str,
        path: str,
        headers: dict[str, str],
        parts: list[Any],
        context: ssl.SSLContext | None = None,
    ) -> tuple[Key, bytes]:
        """The pool key of ``url`` and a request's head (``path`` with its query)."""
        host, port = pod_address(url)
        size = sum(memoryview(p).nbytes for p in parts)
        lines = [f"{method} {path} HTTP/1.1", f"host: {host}:{port}", f"content-length: {size}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return (host, port, context), ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def fetch(
        self,
        method: str,
        url: str,
        path: str,
        headers: dict[str, str],
        parts: list[Any],
        connect_timeout: float,
        read_timeout: float,
        context: ssl.SSLContext | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """A whole request and response (status, headers, body); the connection goes back to
        the pool."""
        conn, status, hdrs = self.request(
            method, url, path, headers, parts, connect_timeout, read_timeout, context
        )
        try:
            body = b"".join(conn.body(hdrs))
        except BaseException:
            conn.close()
            raise
        self.release(conn)
        return status, hdrs, body

    def drop(self, url: str) -> None:
        """Close the idle connections to ``url`` (its pod is gone), with any context."""
        address = pod_address(url)
        with self._lock:
            keys = [k for k in self._idle if k[:2] == address]
            conns = [c for k in keys for c in self._idle.pop(k)]
        for c in conns:
            c.close()

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for c in conns:
                    c.close()
            self._idle.clear()


@functools.lru_cache(maxsize=4096)
def pod_address(url: str) -> tuple[str, int]:
    """A pod URL's (host, port), parsed once (urlsplit is Python code that runs per call)."""
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
