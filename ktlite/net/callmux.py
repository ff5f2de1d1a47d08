"""Calls in flight to pods reached directly, read by one thread: the call multiplexer.

A call sent through :meth:`Pool.request` holds a thread of the caller's until its answer has
come: eight submitted calls in flight were eight threads, each woken by its socket and then
again by the GIL, about twenty-five futex calls per call on the caller's side where the
call itself needs three system calls. :class:`CallMux` sends a call's request from the thread
that starts it and reads every answer on one thread (``epoll``), each as a chunked HTTP/1.1
response of frames (``ktlite_wire.frames``), parsed as its bytes arrive
(:class:`ResponseParser`); the call's ``done`` is called there with its reply or its error.

The bytes on the wire are the same as :mod:`ktlite.net.connection`'s, and the connections
come from and go back to the same :class:`~ktlite.net.connection.Pool`. What a blocking read
would raise, this reports to ``done``: a pod that closes the connection
(:class:`ConnectionFailed`), one that stays silent past the silence timeout
(``TimeoutError``), a malformed stream (``ProtocolError``); a pooled connection the pod had
closed before any byte of the answer came is sent again on a new one, as ``Pool.request``
does.
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

from ktlite.net.connection import Connection, ConnectionFailed, ConnectionRefused, Key, Pool
from ktlite.net.readerthread import ReaderThread
from ktlite_wire import landing
from ktlite_wire.errors import ProtocolError
from ktlite_wire.frames import FrameParser

logger = logging.getLogger(__name__)

HEAD_MAX = 1 << 16  # a response head longer than this is not a pod's
# A pod writes a call's head (90 bytes: "HTTP/1.1 200 OK", its content type, chunked) as soon as
# it has the call, and its frames later: a socket that is readable only from this many bytes
# on (SO_RCVLOWAT) wakes the reader once, with the head and the first frame, where it woke for
# each. Every whole answer is longer (the head and a frame; a refusal's head and JSON); after
# the first frame of a call that goes on, every byte wakes it again (a log line, a heartbeat).
HEAD_LOWAT = 91
READ = 1 << 16  # bytes read at once
Done = Callable[[int, dict[str, str], Any, BaseException | None], None]
# (status, headers, frames or the refusal's body, error): the answer, once whole


class ResponseParser:
    """One HTTP/1.1 response, from bytes as they arrive: its head, then its body (chunked, or
    of a Content-Length); the body of a 2xx answer parsed into frames, any other kept whole
    (a refusal's JSON)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.frames = FrameParser(landing.caller())
        self.refusal = bytearray()
        self.done = False
        self._state = "head"  # head, size, data, crlf, end, body
        self._left = 0  # bytes due of the current chunk (or of a Content-Length body)

    @property
    def reusable(self) -> bool:
        return self.done and not self.buf and self.headers.get("connection", "") != "close"

    def feed(self, data: bytes) -> list[tuple[int, Any]]:
        """The frames completed by ``data``; raises ConnectionFailed or ProtocolError on a
        stream that is not a pod's answer."""
        if self.buf:  # the rest of a line or head that came before
            data = bytes(self.buf) + data
            self.buf.clear()
        out: list[tuple[int, Any]] = []
        pos, end = 0, len(data)
        while pos < end and not self.done:
            state = self._state
            if state == "data" or state == "body":
                take = min(self._left, end - pos)
                out += self._body(memoryview(data)[pos : pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    if state == "body":
                        self.done = True
                    else:
                        self._state = "crlf"
            elif state == "crlf":  # after a chunk's data
                if end - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise ConnectionFailed("the pod sent a chunk longer than its size line")
                pos += 2
                self._state = "size"
            elif state == "head":
                at = data.find(b"\r\n\r\n", pos)
                if at < 0:
                    if end - pos > HEAD_MAX:
                        raise ConnectionFailed("a response head of more than 64 KiB")
                    break
                self._head(data[pos:at])
                pos = at + 4
            else:  # a chunk's size line, or the line that ends the body
                at = data.find(b"\r\n", pos)
                if at < 0:
                    break
                line, pos = data[pos:at], at + 2
                if state == "end":
                    self.done = not line  # trailers: none are sent; skip any
                    continue
                try:
                    self._left = int(line.split(b";")[0], 16)
                except ValueError:
                    raise ConnectionFailed("bad chunk size line") from None
                self._state = "data" if self._left else "end"
        if pos < end:
            self.buf += data[pos:]  # a part line (or, after the end, bytes of no answer)
        return out

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        try:
            self.status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            raise ConnectionFailed(f"bad status line {lines[0][:60]!r}") from None
        for line in lines[1:]:
            k, _, v = line.decode("latin-1").partition(":")
            self.headers[k.strip().lower()] = v.strip()
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            self._state = "size"
            return
        self._state, self._left = "body", int(self.headers.get("content-length", "0"))
        self.done = not self._left

    def _body(self, piece: memoryview) -> list[tuple[int, Any]]:
        if self.status >= 400:
            self.refusal += piece
            return []
        return self.frames.feed(piece)


class _Answer:
    """A call whose answer is being read: its connection, parser, deadline and sinks."""

    def __init__(
        self,
        conn: Connection,
        reused: bool,
        on_frame: Callable[[int, Any], None],
        done: Done,
        silence: float,
        resend: Callable[[], None],
    ) -> None:
        self.conn = conn
        self.reused = reused
        self.on_frame = on_frame
        self.done = done
        self.silence = silence
        self.deadline = time.monotonic() + silence
        self.resend = resend
        self.parser = ResponseParser()
        self.heard = False  # any byte of the answer came
        self.woken = False  # its connection wakes the reader from its first byte on


class CallMux(ReaderThread):
    """Reads the answers of calls in flight (one thread, ``epoll``); safe to start calls from
    any thread."""

    thread_name = "ktlite-calls"

    def __init__(self, pool: Pool) -> None:
        super().__init__()
        self.pool = pool
        self._answers: dict[int, _Answer] = {}
        self._ended: list[tuple[Done, tuple[Any, ...]]] = []  # the loop's thread's only

    def _forget_all(self) -> None:
        """In a forked child: the parent's calls in flight and its kept connections are not
        this process's (its copies of their sockets are closed here only; the parent reads
        them on); the child's next call connects anew and starts a reader of its own."""
        for answer in self._answers.values():
            answer.conn.close()
        self._answers, self._ended = {}, []
        self.pool.forget_inherited()

    def start(
        self,
        url: str,
        path: str,
        headers: dict[str, str],
        parts: list[Any],
        context: ssl.SSLContext | None,
        silence: float,
        on_frame: Callable[[int, Any], None],
        done: Done,
        connect_timeout: float = 10.0,
    ) -> None:
        """Send a POST and read its answer on the mux's thread: ``on_frame(kind, payload)``
        for each frame of a 2xx answer as it comes, then ``done`` once (also with the error
        of a request that could not be sent: ConnectionRefused when nothing was)."""
        key, head = self.pool.prepare("POST", url, path, headers, parts, context)
        self._send(key, head, parts, connect_timeout, silence, on_frame, done, fresh=False)

    def _send(
        self,
        key: Key,
        head: bytes,
        parts: list[Any],
        connect_timeout: float,
        silence: float,
        on_frame: Callable[[int, Any], None],
        done: Done,
        fresh: bool,
    ) -> None:
        if self._on_reader() and (fresh or not self.pool.has_idle(key)):
            # a connect may take its whole timeout (a pod whose address swallows packets):
            # never on the thread that reads the other calls' answers
            threading.Thread(
                target=self._send,
                args=(key, head, parts, connect_timeout, silence, on_frame, done, fresh),
                name="ktlite-calls-connect",
                daemon=True,
            ).start()
            return
        try:
            conn, reused = self.pool.take(key, connect_timeout, fresh)
        except ConnectionRefused as e:
            done(0, {}, None, e)
            return
        try:
            conn.send(head, parts, connect_timeout)
        except OSError as e:
            conn.close()
            if reused:  # an idle connection the pod had closed: nothing was processed
                self._send(key, head, parts, connect_timeout, silence, on_frame, done, True)
            else:
                done(0, {}, None, ConnectionFailed(f"{key[0]}:{key[1]}: {e}"))
            return

        def resend() -> None:
            self._send(key, head, parts, connect_timeout, silence, on_frame, done, True)

        if not conn.nonblocking:  # it stays so in the pool: one system call less per call
            conn.sock.setblocking(False)
            conn.nonblocking = True
            if not isinstance(conn.sock, ssl.SSLSocket):  # TLS records are longer anyway
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, HEAD_LOWAT)
                conn.lowat = HEAD_LOWAT
        answer = _Answer(conn, reused, on_frame, done, silence, resend)
        fd = conn.sock.fileno()
        epoll = self._running()
        self._answers[fd] = answer
        epoll.register(fd, select.EPOLLIN | select.EPOLLRDHUP)

    def _fail_all(self, error: Exception) -> None:
        for fd, answer in list(self._answers.items()):
            self._end(fd, answer, ConnectionFailed(f"the caller's call reader failed: {error!r}"))
        self._finish()

    def _turn(self) -> None:
        """One wait for answers: what came is read, silent calls fail, ended calls end."""
        epoll = self._epoll
        answers = self._answers
        now = time.monotonic()
        wait = min((a.deadline for a in list(answers.values())), default=now + 1.0) - now
        try:
            events = epoll.poll(max(0.0, min(wait, 1.0)))
        except InterruptedError:
            return
        for fd, _ in events:
            answer = answers.get(fd)
            if answer is not None:
                self._read(fd, answer)
        now = time.monotonic()
        for fd, answer in list(answers.items()):
            if answer.deadline < now:
                self._read(fd, answer)  # bytes short of HEAD_LOWAT wake no one: read them
                if answers.get(fd) is not answer or answer.deadline >= now:
                    continue  # they came
                self._end(
                    fd,
                    answer,
                    TimeoutError(f"no frame and no heartbeat for {answer.silence:g}s"),
                )
        self._finish()

    def _finish(self) -> None:
        """The calls that ended, once every answer that came is read: what their ``done``
        starts (the next calls) leaves in one go, before their waiters wake."""
        ended, self._ended = self._ended, []
        for done, args in ended:
            try:
                done(*args)
            except BaseException:  # noqa: BLE001 - never the mux's thread
                logger.exception("a call's completion failed")

    def _read(self, fd: int, answer: _Answer) -> None:
        sock, parser = answer.conn.sock, answer.parser
        try:
            while not parser.done:
                try:
                    data = sock.recv(READ)
                except (BlockingIOError, ssl.SSLWantReadError):
                    return
                if not data:
                    if not answer.heard and answer.reused:
                        self._forget(fd)  # the pod had closed it while idle: send again
                        answer.conn.close()
                        threading.Thread(target=answer.resend, daemon=True).start()
                        return
                    if parser.frames.mid_frame:  # as Connection.frames says it
                        raise ConnectionFailed(
                            f"the pod closed the connection after {parser.frames.where()}: the "
                            "frame, and the value in it, are lost (the pod's log says why)"
                        )
                    raise ConnectionFailed("the pod closed the connection")
                answer.heard = True
                answer.deadline = time.monotonic() + answer.silence
                for kind, payload in parser.feed(data):
                    answer.on_frame(kind, payload)
                if not parser.done and answer.conn.lowat > 1:  # the call goes on
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                    answer.conn.lowat, answer.woken = 1, True
                more = isinstance(sock, ssl.SSLSocket) and sock.pending()  # decrypted, held
                if not parser.done and len(data) < READ and not more:
                    return  # all there was (epoll says when more comes): no recv to learn it
        except (ConnectionFailed, ProtocolError) as e:
            self._end(fd, answer, e)
            return
        except OSError as e:  # a reset connection
            self._end(fd, answer, ConnectionFailed(f"{e!r}"))
            return
        except BaseException as e:  # noqa: BLE001 - a sink's error ends its own call only
            self._end(fd, answer, e)
            return
        self._end(fd, answer, None)

    def _forget(self, fd: int) -> None:
        self._answers.pop(fd, None)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)

    def _end(self, fd: int, answer: _Answer, error: BaseException | None) -> None:
        self._forget(fd)
        parser, conn = answer.parser, answer.conn
        if error is None and parser.frames.mid_frame:
            error = ProtocolError("stream ended inside a frame")
        if error is None and parser.reusable and answer.woken:  # ready for the next call
            with contextlib.suppress(OSError):
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, HEAD_LOWAT)
                conn.lowat = HEAD_LOWAT
        if error is None and parser.reusable:
            conn.reusable = True
            self.pool.release(conn)
        else:
            conn.close()
        body: Any = bytes(parser.refusal) if parser.status >= 400 else None
        self._ended.append((answer.done, (parser.status, parser.headers, body, error)))
