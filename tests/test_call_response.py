"""A call's response written by the pod server itself (``ktlite_server.callresponse``).

A real uvicorn server (uvloop, the pod server's own protocol ``connections.guarded``) runs in a
thread, plain and TLS, with a small ASGI app that answers with a call's frame stream
(``streams.CallStream`` behind ``calls.StreamResponse``, as ``POST /call`` does). The client is
ktlite's own lean connection, or a raw socket where the test needs the bytes. Counts of the
server's socket writes come from the transport itself (a counting wrapper), not from timing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from served_app import Served

from ktlite.net.connection import Pool
from ktlite_server import streams
from ktlite_server.calls import StreamResponse
from ktlite_server.connections import GuardedHttpTools, Limits, guarded
from ktlite_server.streams import CallStream
from ktlite_wire import frames, pinning
from ktlite_wire.frames import RESULT

TOKEN = "call-response-test-token"
WAIT_S = 30.0  # every wait's bound; a healthy run takes milliseconds


class CountingTransport:
    """A transport that counts the writes made on it (each a socket write, or a TLS record)."""

    def __init__(self, inner: Any, writes: list[int]) -> None:
        self._inner = inner
        self._writes = writes

    def write(self, data: Any) -> None:
        self._writes.append(memoryview(data).nbytes)
        self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def counting(writes: list[int]) -> type[GuardedHttpTools]:
    """The pod server's protocol, its transport's writes counted into ``writes``."""
    base = guarded(Limits())

    class Counted(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(CountingTransport(transport, writes))

    return Counted


@pytest.fixture(params=["plain", "tls"])
def serve(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(app: Any, protocol: Any = None) -> Served:
        tls_dir = tmp_path if request.param == "tls" else None
        started.append(Served(app, tls_dir, TOKEN, protocol))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _result(value: bytes) -> bytes:
    return frames.frame(RESULT, value)


def _call_app(events: list[str], later: Callable[[CallStream], None] | None = None) -> Any:
    """Answers ``POST /call`` with a call stream; its frames come from ``later`` (run on the
    loop once the response has begun), by default one result ``b"done"`` and the end. Any
    other request: a small JSON answer through ``send``."""

    def quick(stream: CallStream) -> None:
        stream.emit(_result(b"done"))
        stream.finish()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] != "/call":
            body = json.dumps({"path": scope["path"]}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        while (await receive()).get("more_body"):
            pass
        stream = CallStream("c1", 0.0, lambda: events.append("abandoned"))
        # after the response began: the frames are not there when it starts
        asyncio.get_running_loop().call_soon(later or quick, stream)
        await StreamResponse(stream, 0)(scope, receive, send)
        events.append("answered")

    return app


def _socket_to(served: Served) -> Any:
    """A raw socket to ``served``, TLS-wrapped (pinned) where it serves TLS."""
    raw = socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S)
    if served.context is None:
        return raw
    return served.context.wrap_socket(raw, server_hostname=pinning.SERVER_NAME)


def _frames_of(
    pool: Pool, served: Served, headers: dict[str, str] | None = None
) -> list[tuple[int, Any]]:
    conn, status, hdrs = pool.post(
        served.url, "/call", headers or {}, [b""], 10.0, WAIT_S, served.context
    )
    assert status == 200
    assert hdrs["content-type"] == "application/x-ktlite-frames"
    got = list(conn.frames(hdrs))
    pool.release(conn)
    return got


def test_the_frames_due_leave_in_one_write_after_the_head(serve: Callable[..., Served]) -> None:
    """The head at once; then the frames that are due and the chunked body's end together,
    in one write (through uvicorn's ``send``: a write per frame)."""
    writes: list[int] = []
    events: list[str] = []

    def several(stream: CallStream) -> None:
        for _ in range(3):
            stream.emit(frames.frame(frames.HEARTBEAT, b""))
        stream.emit(_result(b"done"))
        stream.finish()

    served = serve(_call_app(events, later=several), counting(writes))
    want = [(frames.HEARTBEAT, b"")] * 3 + [(RESULT, b"done")]
    pool = Pool()
    try:
        assert _frames_of(pool, served) == want
        writes.clear()
        assert _frames_of(pool, served) == want  # the kept-alive connection again
    finally:
        pool.close()
    assert len(writes) == 2, f"the server wrote the answer in {len(writes)} writes: {writes}"


def test_a_silent_call_beats_on_the_servers_own_writer(
    serve: Callable[..., Served], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with nothing to say answers its head at once and then heartbeats, written by
    the server's own writer as by ``send``."""
    monkeypatch.setattr(streams, "HEARTBEAT_S", 0.05)
    events: list[str] = []
    calls: list[CallStream] = []
    served = serve(_call_app(events, later=calls.append))
    sock = _socket_to(served)
    try:
        sock.sendall(b"POST /call HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got:
            piece = sock.recv(65536)
            assert piece, "the server closed the connection before its head"
            got += piece
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"transfer-encoding: chunked" in head.lower()
        # the first chunk is a heartbeat frame (the stream had nothing else to say)
        while b"\r\n" not in rest or len(rest) < rest.index(b"\r\n") + 2 + int(
            rest.split(b"\r\n")[0], 16
        ):
            rest += sock.recv(65536)
        size = int(rest.split(b"\r\n")[0], 16)
        start = rest.index(b"\r\n") + 2
        assert list(frames.read_frames([rest[start : start + size]])) == [(frames.HEARTBEAT, b"")]
    finally:
        sock.close()
    deadline = time.monotonic() + WAIT_S
    while "abandoned" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "abandoned" in events  # the caller left: the call is given up (no re-attach window)


def test_a_caller_that_leaves_mid_call_abandons_it(
    serve: Callable[..., Served],
) -> None:
    """The disconnect is learnt from the connection itself (no task awaits ``receive()``)."""
    events: list[str] = []
    calls: list[CallStream] = []
    served = serve(_call_app(events, later=calls.append))
    sock = _socket_to(served)
    sock.sendall(b"POST /call HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    deadline = time.monotonic() + WAIT_S
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls, "the call never began"
    sock.close()
    while "answered" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ["abandoned", "answered"]


def test_the_connection_serves_other_requests_after_a_call(serve: Callable[..., Served]) -> None:
    """After a response the server wrote itself, the kept-alive connection takes the next
    request, through uvicorn as usual; a caller's ``connection: close`` closes it."""
    events: list[str] = []
    served = serve(_call_app(events))
    pool = Pool()
    try:
        assert _frames_of(pool, served) == [(RESULT, b"done")]
        status, _, body = pool.fetch(
            "GET", served.url, "/health", {}, [], 10.0, WAIT_S, served.context
        )
        assert (status, json.loads(body)) == (200, {"path": "/health"})
        conn, status, hdrs = pool.post(
            served.url, "/call", {"connection": "close"}, [b""], 10.0, WAIT_S, served.context
        )
        assert hdrs.get("connection") == "close"
        assert list(conn.frames(hdrs)) == [(RESULT, b"done")]
        assert conn.reader.read(1) == b""  # the server closed it
        conn.close()
    finally:
        pool.close()


def test_without_the_pod_servers_protocol_the_answer_goes_through_send(
    serve: Callable[..., Served],
) -> None:
    """Under a server without the pod server's protocol (uvicorn's own httptools), the same
    frames arrive through ASGI ``send``."""
    events: list[str] = []

    def several(stream: CallStream) -> None:
        stream.emit(frames.frame(frames.HEARTBEAT, b""))
        stream.emit(_result(b"x" * 100))
        stream.finish()

    served = serve(_call_app(events, later=several), "httptools")
    pool = Pool()
    try:
        assert _frames_of(pool, served) == [(frames.HEARTBEAT, b""), (RESULT, b"x" * 100)]
    finally:
        pool.close()
    assert events == ["answered"]
