"""``ktlite.net.callmux``: a call's answer parsed as its bytes arrive, and read on the mux's
one thread from a real socket (a raw HTTP/1.1 server in a thread: what a pod's connection
does at the byte level, including closing an idle keep-alive connection)."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading

import pytest

from ktlite.net.callmux import CallMux, ResponseParser
from ktlite.net.connection import ConnectionFailed, Pool
from ktlite_wire.frames import LOG, RESULT, frame

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ktlite-frames\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunked(*frames: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(f), f) for f in frames) + b"0\r\n\r\n"


def _answer(result: bytes = b"value") -> tuple[bytes, list[tuple[int, bytes]]]:
    frames = [frame(LOG, b"a line"), frame(RESULT, result)]
    return HEAD + _chunked(*frames), [(LOG, b"a line"), (RESULT, result)]


@pytest.mark.parametrize("step", [1, 3, 7, 1 << 20])
def test_an_answer_parses_the_same_in_any_pieces(step: int) -> None:
    wire, frames = _answer(b"r" * 5000)
    parser = ResponseParser()
    got = []
    for i in range(0, len(wire), step):
        got += [(k, bytes(p)) for k, p in parser.feed(wire[i : i + step])]
    assert got == frames
    assert parser.done and parser.reusable and parser.status == 200


def test_a_refusal_is_kept_whole_and_a_bad_chunk_is_an_error() -> None:
    body = b'{"detail": "no launch"}'
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 409 Conflict\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    assert parser.done and parser.status == 409 and bytes(parser.refusal) == body
    parser = ResponseParser()
    with pytest.raises(ConnectionFailed, match="chunk size"):
        parser.feed(HEAD + b"zz\r\n")
    parser = ResponseParser()
    parser.feed(HEAD + b"3\r\nabc\r\n")
    assert not parser.done and not parser.reusable  # mid-body: not reusable


class OneShotServer:
    """Answers the first request of each connection, then (``drop_second``) closes a kept
    connection when its second request comes (as a pod that timed it out while idle), or
    closes the connection at once."""

    def __init__(self, answer: bytes, drop_second: bool) -> None:
        self.answer, self.drop_second = answer, drop_second
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            served = 0
            buf = b""
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while b"\r\n\r\n" in buf:
                    _, buf = buf.split(b"\r\n\r\n", 1)
                    if served and self.drop_second:
                        return  # closed without a byte of an answer: nothing was processed
                    self.requests += 1
                    served += 1
                    conn.sendall(self.answer)
                    if not self.drop_second:
                        return


def _call(mux: CallMux, url: str) -> tuple[list, int, BaseException | None]:
    seen: list = []
    ended: concurrent.futures.Future = concurrent.futures.Future()

    def done(status, headers, body, error) -> None:
        ended.set_result((status, error))

    mux.start(url, "/call", {}, [], None, 10.0, lambda k, p: seen.append((k, bytes(p))), done)
    status, error = ended.result(timeout=30)
    return seen, status, error


def test_a_kept_connection_the_pod_closed_is_sent_again_on_a_new_one() -> None:
    wire, frames = _answer()
    server = OneShotServer(wire, drop_second=True)
    pool = Pool()
    mux = CallMux(pool)
    url = f"http://127.0.0.1:{server.port}"
    try:
        assert _call(mux, url) == (frames, 200, None)  # the connection goes back to the pool
        assert _call(mux, url) == (frames, 200, None)  # dropped, then sent on a new one
        assert server.connections == 2 and server.requests == 2
    finally:
        pool.close()


def test_a_connection_closed_mid_answer_is_the_calls_error() -> None:
    wire, _ = _answer(b"r" * 5000)
    server = OneShotServer(wire[: len(wire) - 3000], drop_second=False)  # cut inside a frame
    pool = Pool()
    try:
        seen, _, error = _call(CallMux(pool), f"http://127.0.0.1:{server.port}")
    finally:
        pool.close()
    assert isinstance(error, ConnectionFailed), error
    assert "the value in it, are lost" in str(error)
    assert [k for k, _ in seen] == [LOG]


def test_a_forked_child_reads_its_own_answers() -> None:
    """A child forked after a call through a mux calls through it: the parent's reader thread
    and its kept connection are not the child's (it reads its answer on a thread of its own,
    on a connection of its own), and the parent's go on."""
    wire, frames = _answer()
    server = OneShotServer(wire, drop_second=False)
    pool = Pool()
    mux = CallMux(pool)
    url = f"http://127.0.0.1:{server.port}"
    try:
        assert _call(mux, url) == (frames, 200, None)  # the reader runs; a kept connection
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never past this block
            try:
                seen: list = []
                ended: concurrent.futures.Future = concurrent.futures.Future()
                mux.start(
                    url,
                    "/call",
                    {},
                    [],
                    None,
                    10.0,
                    lambda k, p: seen.append((k, bytes(p))),
                    lambda status, headers, body, error: ended.set_result((status, error)),
                )
                try:
                    got = (seen, *ended.result(timeout=20))
                except concurrent.futures.TimeoutError:
                    got = "no answer in 20s"
                os.write(write, b"ok" if got == (frames, 200, None) else repr(got).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as r:
            answer = r.read()
        os.waitpid(pid, 0)
        assert answer == b"ok"
        assert _call(mux, url) == (frames, 200, None)  # the parent's mux goes on
    finally:
        pool.close()
