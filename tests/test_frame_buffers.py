"""A length a peer claims allocates nothing before its bytes arrive (issue 25, item 8).

The readers of a pod's frame stream (the caller, and pod 0 reading the other pods), of the
HTTP body under it and of the rank channel each used to allocate the claimed length at once:
a header could ask for up to 64 GiB. Here a header claims 256 MiB and 1 KiB follows; what the
reader allocates is measured with ``tracemalloc``, which sees every ``bytearray``/``bytes``.
"""

from __future__ import annotations

import socket
import threading
import tracemalloc
from collections.abc import Callable

import pytest

from ktlite.net.call_reply import FrameReader
from ktlite.net.connection import Connection, ConnectionFailed
from ktlite_wire import codec, rankchannel, rankend
from ktlite_wire.envelope import join
from ktlite_wire.frames import FRAME, RESULT, FrameParser
from ktlite_wire.outcome import CallResult, RankOutcome
from ktlite_wire.status import Status

CLAIM = 256 << 20
ARRIVED = b"x" * 1024
LIMIT = 16 << 20  # what reading 1 KiB may cost, with room for the interpreter's own


def _peak(read: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        read()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_frame_parser_grows_with_the_bytes_that_arrive() -> None:
    parser = FrameParser()
    peak = _peak(lambda: parser.feed(FRAME.pack(RESULT, CLAIM) + ARRIVED))
    assert peak < LIMIT, f"a frame claiming {CLAIM} bytes cost {peak} with 1 KiB arrived"
    assert parser.mid_frame


def test_frame_parser_still_reads_large_frames_whole() -> None:
    big = bytes(range(256)) * (12 << 12)  # 12 MiB, fed in uneven pieces
    stream = FRAME.pack(RESULT, len(big)) + big
    parser, got = FrameParser(), []
    for i in range(0, len(stream), 65531):
        got += parser.feed(stream[i : i + 65531])
    assert [(k, bytes(p)) for k, p in got] == [(RESULT, big)]
    assert not parser.mid_frame


def _serve_once(reply: bytes) -> tuple[socket.socket, threading.Thread]:
    """A pod-like peer that answers one request with ``reply`` and closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("lie", ["chunk", "frame", "content-length"])
def test_caller_reading_a_pods_stream_allocates_as_bytes_arrive(lie: str) -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    stream = FRAME.pack(RESULT, CLAIM) + ARRIVED  # a frame's header, 1 KiB of its payload
    if lie == "chunk":  # the chunk size line lies too
        body = f"{CLAIM:x}\r\n".encode() + stream
    elif lie == "frame":  # an honest chunk carrying the frame header that lies
        body = f"{len(stream):x}\r\n".encode() + stream + b"\r\n"
    else:
        head = f"HTTP/1.1 200 OK\r\ncontent-length: {CLAIM}\r\n\r\n".encode()
        body = stream
    listener, thread = _serve_once(head + body)
    with listener:
        conn = Connection("127.0.0.1", listener.getsockname()[1], 10.0)
        conn.sock.settimeout(30.0)
        conn.send(b"POST /call HTTP/1.1\r\ncontent-length: 0\r\n\r\n", [])
        _, headers = conn.response(30.0)
        reader = FrameReader(None, None, "http://pod")

        def read() -> None:
            with pytest.raises(ConnectionFailed, match="closed the connection"):
                reader.read(conn.body(headers))

        try:
            peak = _peak(read)
        finally:
            conn.close()
    thread.join(30)
    assert peak < LIMIT, f"a {lie} claiming {CLAIM} bytes cost {peak} with 1 KiB arrived"


def test_caller_still_reads_a_large_result_through_the_stream() -> None:
    value = bytes(range(256)) * (8 << 12)  # 8 MiB in one chunk
    result = CallResult([RankOutcome(0, "pod-0", Status.OK, codec.dumps(value))])
    payload = join(result.encode())
    inner = FRAME.pack(RESULT, len(payload)) + payload
    reply = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        + f"{len(inner):x}\r\n".encode()
        + inner
        + b"\r\n0\r\n\r\n"
    )
    listener, thread = _serve_once(reply)
    with listener:
        conn = Connection("127.0.0.1", listener.getsockname()[1], 10.0)
        conn.sock.settimeout(30.0)
        conn.send(b"POST /call HTTP/1.1\r\ncontent-length: 0\r\n\r\n", [])
        _, headers = conn.response(30.0)
        got = FrameReader(None, None, "http://pod").read(conn.body(headers))
        conn.close()
    thread.join(30)
    assert codec.loads(got.outcomes[0].data) == value


def test_rank_channel_grows_with_the_bytes_that_arrive() -> None:
    server, rank = socket.socketpair()
    with server, rank:
        server.sendall(rankchannel.LEN.pack(CLAIM) + ARRIVED)
        server.shutdown(socket.SHUT_WR)
        channel = rankend.Channel(rank)

        def read() -> None:
            with pytest.raises(EOFError, match="1024 bytes into a message of"):
                channel.recv()

        peak = _peak(read)
    assert peak < LIMIT, f"a rank message claiming {CLAIM} bytes cost {peak}"


def test_rank_channel_still_reads_a_large_message() -> None:
    server, rank = socket.socketpair()
    bundle = bytes(range(256)) * (12 << 12)  # 12 MiB, more than one piece
    msg = rankchannel.Load(env={"A": "1"}, bundle=bundle)
    with server, rank:
        writer = threading.Thread(
            target=lambda: [
                server.sendall(memoryview(p).cast("B")) for p in rankchannel.encode(msg)
            ]
        )
        writer.start()
        got = rankend.Channel(rank).recv()
        writer.join(30)
    assert isinstance(got, rankchannel.Load) and bytes(got.bundle or b"") == bundle
