"""Peer links (issue 26, item 4): a pod's calls to another pod over one persistent connection
(``ktlite_server.linkclient`` / ``linkserver``), opened with the deployment's token on the pod
server's own port, plain or TLS; a link that breaks fails its calls at once and the next call
opens a new one; a silent stream times out alone and is closed.

The servers are real: uvicorn with the pod server's own protocol (``tests/served_app``), the
pod server's app, and a hand-written peer where a test needs a peer that misbehaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from served_app import Served
from starlette.requests import Request

from ktlite_server import linkclient
from ktlite_server.admission import Gate, Token
from ktlite_server.app import create_app
from ktlite_server.calls import StreamResponse
from ktlite_server.connections import Limits
from ktlite_server.linkserver import Links
from ktlite_server.peers import PeerConnectError, PeerError, PeerPool, PeerTimeout
from ktlite_server.pod import Pod
from ktlite_server.streams import CallStream
from ktlite_wire import frames, linkframes
from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import CALL_HEADER, ERROR_CODE_HEADER, TOKEN_HEADER, VERSION_HEADER
from ktlite_wire.version import PROTOCOL_VERSION

TOKEN = "peer-link-test-token"
WAIT_S = 30.0  # a guard against a hang; every answer here takes milliseconds
AUTH = {TOKEN_HEADER: f"Bearer {TOKEN}", VERSION_HEADER: str(PROTOCOL_VERSION)}


@pytest.fixture(params=["plain", "tls"])
def serve(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[Any], Served]]:
    started: list[Served] = []

    def start(app: Any) -> Served:
        started.append(Served(app, tmp_path if request.param == "tls" else None, TOKEN))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _echo_app(events: list[str], idle_s: float = 75.0) -> Any:
    """A pod server's front (the token gate, then links) whose calls answer their body back
    as a result frame, after a log frame."""

    async def serve_call(request: Any) -> StreamResponse:
        body = await request.body()
        stream = CallStream(request.headers[CALL_HEADER], 0.0, lambda: events.append("abandoned"))
        stream.emit(frames.log_frame(0, "pod-1", "stdout", "hello"))
        stream.emit(frames.frame(frames.RESULT, bytes(body)))
        stream.finish()
        return StreamResponse(stream, 0)

    async def other(scope: Any, receive: Any, send: Any) -> None:  # POST /call over HTTP
        await (await serve_call(Request(scope, receive)))(scope, receive, send)

    return Gate(Links(other, serve_call, 1 << 20, idle_s), Token(TOKEN), Limits())


async def _frames(resp: Any) -> list[tuple[int, bytes]]:
    parser = frames.FrameParser()
    return [
        (kind, bytes(data))
        async for chunk in resp.iter_chunks()
        for kind, data in parser.feed(chunk)
    ]


def _raw_link_request(served: Served, headers: dict[str, str]) -> bytes:
    """What the pod server answers a link request with ``headers`` (its head and some body)."""
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S)
    if served.context is not None:
        sock = served.context.wrap_socket(sock, server_hostname="ktlite-pod")
    with sock:
        head = ["POST /link HTTP/1.1", "host: x", "content-length: 0"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        return sock.recv(4096)


def test_a_link_needs_the_deployment_token(serve: Callable[[Any], Served]) -> None:
    served = serve(_echo_app([]))
    assert _raw_link_request(served, {}).startswith(b"HTTP/1.1 401")
    wrong = {TOKEN_HEADER: "Bearer not-the-token", VERSION_HEADER: str(PROTOCOL_VERSION)}
    assert _raw_link_request(served, wrong).startswith(b"HTTP/1.1 401")
    assert _raw_link_request(served, AUTH).startswith(b"HTTP/1.1 101")

    async def main() -> tuple[int, str, str]:
        # a refused link reads as the pod's answer to the call, as a refused POST /call does
        pool = PeerPool({TOKEN_HEADER: "Bearer not-the-token"}, tls=served.context)
        async with linkclient.post(
            pool, served.url, "/call", {CALL_HEADER: "c1"}, memoryview(b"x")
        ) as resp:
            got = resp.status, resp.headers.get(ERROR_CODE_HEADER, ""), (await resp.read()).decode()
        assert not pool.links
        await pool.aclose()
        return got

    status, code, text = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert (status, code) == (401, ErrorCode.UNAUTHORIZED.value), text
    assert "token" in text


def test_calls_share_one_link_and_read_as_http_answers(serve: Callable[[Any], Served]) -> None:
    events: list[str] = []
    served = serve(_echo_app(events))

    async def main() -> list[list[tuple[int, bytes]]]:
        pool = PeerPool(AUTH, tls=served.context)
        got = []

        async def one(i: int) -> list[tuple[int, bytes]]:
            body = memoryview(b"argument %d" % i)
            async with linkclient.post(
                pool, served.url, "/call", {CALL_HEADER: f"c{i}"}, body
            ) as resp:
                assert resp.status == 200
                return await _frames(resp)

        got.append(await one(0))
        got += await asyncio.gather(*(one(i) for i in range(1, 4)))  # at once, on the one link
        assert len(pool.links) == 1 and pool.fresh(served.url)
        await pool.aclose()
        return got

    got = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    for i, answer in enumerate(got):
        assert [kind for kind, _ in answer] == [frames.LOG, frames.RESULT]
        assert answer[1][1] == b"argument %d" % i
    assert "abandoned" not in events  # every stream was read to its end


def test_a_pod_without_code_refuses_a_call_over_a_link_as_over_http(
    serve: Callable[[Any], Served],
) -> None:
    served = serve(create_app(Pod("pod-1", 1), TOKEN))
    meta = json.dumps({"id": "c1", "pods": [served.url, served.url], "fanout": False})

    async def main() -> tuple[int, str, str]:
        pool = PeerPool(AUTH, tls=served.context)
        async with linkclient.post(
            pool, served.url, "/call", {CALL_HEADER: meta}, memoryview(b"")
        ) as resp:
            status, code, text = (
                resp.status,
                resp.headers.get(ERROR_CODE_HEADER, ""),
                (await resp.read()).decode(),
            )
        assert len(pool.links) == 1  # it went over the link
        await pool.aclose()
        return status, code, text

    status, code, text = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert (status, code) == (409, ErrorCode.NOT_DEPLOYED.value), text
    assert "has no code deployed" in text


class _Peer:
    """A hand-written peer that answers link requests; ``script(stream, writer)`` answers each
    CALL. Counts the links opened and records the CLOSE messages it got."""

    def __init__(self, script: Callable[[int, asyncio.StreamWriter], Any]) -> None:
        self.script = script
        self.links = 0
        self.closed: list[int] = []
        self.closed_event = asyncio.Event()
        self.handlers: list[asyncio.Task[Any]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        self.links += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(linkframes.SWITCH)
        parse = linkframes.Reader()
        try:
            while data := await reader.read(1 << 16):
                for kind, stream, _ in parse.feed(data):
                    if kind == linkframes.CALL:
                        await self.script(stream, writer)
                    elif kind == linkframes.CLOSE:
                        self.closed.append(stream)
                        self.closed_event.set()
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def stop(self, server: asyncio.AbstractServer) -> None:
        """Once the client closed its links: every handler has ended."""
        server.close()
        await asyncio.wait_for(asyncio.gather(*self.handlers), WAIT_S)

    async def start(self) -> tuple[asyncio.AbstractServer, str]:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _answer(stream: int, body: bytes) -> bytes:
    data = frames.frame(frames.RESULT, body)
    return (
        linkframes.head_message(stream, 200)
        + linkframes.header(linkframes.DATA, stream, len(data))
        + data
        + linkframes.header(linkframes.END, stream, 0)
    )


def test_a_link_that_breaks_fails_its_call_at_once_and_the_next_call_opens_another() -> None:
    calls = 0

    async def script(stream: int, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # the first call begins, then its pod is gone
            writer.write(linkframes.head_message(stream, 200))
            await writer.drain()
            writer.transport.abort()
            return
        writer.write(_answer(stream, b"second"))
        await writer.drain()

    async def main() -> tuple[BaseException, list[tuple[int, bytes]], int]:
        peer = _Peer(script)
        server, url = await peer.start()
        pool = PeerPool(AUTH)
        # a read timeout far longer than the test: the break, not silence, must end the wait
        async with linkclient.post(
            pool, url, "/call", {CALL_HEADER: "a"}, memoryview(b""), read_timeout=3600
        ) as resp:
            assert resp.status == 200
            with pytest.raises(PeerError) as lost:
                await _frames(resp)
        async with linkclient.post(
            pool, url, "/call", {CALL_HEADER: "b"}, memoryview(b""), read_timeout=3600
        ) as resp:
            second = await _frames(resp)
        await pool.aclose()
        await peer.stop(server)
        return lost.value, second, peer.links

    error, second, links = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert not isinstance(error, PeerTimeout)
    assert "closed the link" in str(error)
    assert second == [(frames.RESULT, b"second")]
    assert links == 2


def test_a_silent_stream_times_out_alone_and_is_closed() -> None:
    async def script(stream: int, writer: asyncio.StreamWriter) -> None:
        if stream == 1:  # the first call's pod answers its head, then nothing
            writer.write(linkframes.head_message(stream, 200))
        else:
            writer.write(_answer(stream, b"fine"))
        await writer.drain()

    async def main() -> tuple[list[tuple[int, bytes]], list[int], int]:
        peer = _Peer(script)
        server, url = await peer.start()
        pool = PeerPool(AUTH)
        async with linkclient.post(
            pool, url, "/call", {CALL_HEADER: "a"}, memoryview(b""), read_timeout=0.3
        ) as resp:
            with pytest.raises(PeerTimeout, match="sent nothing for 0.3s"):
                await _frames(resp)
        await asyncio.wait_for(peer.closed_event.wait(), WAIT_S)
        # the link itself is fine: the next call goes over it
        async with linkclient.post(
            pool, url, "/call", {CALL_HEADER: "b"}, memoryview(b""), read_timeout=3600
        ) as resp:
            fine = await _frames(resp)
        await pool.aclose()
        await peer.stop(server)
        return fine, peer.closed, peer.links

    fine, closed, links = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert closed == [1]
    assert fine == [(frames.RESULT, b"fine")]
    assert links == 1


def test_a_large_body_goes_as_an_http_request_of_its_own(serve: Callable[[Any], Served]) -> None:
    served = serve(_echo_app([]))
    body = memoryview(b"x" * (linkclient.BODY_MAX + 1))

    async def main() -> list[tuple[int, bytes]]:
        pool = PeerPool(AUTH, tls=served.context)
        async with linkclient.post(pool, served.url, "/call", {CALL_HEADER: "c1"}, body) as resp:
            got = await _frames(resp)
        assert not pool.links  # no link was opened for it
        await pool.aclose()
        return got

    assert asyncio.run(asyncio.wait_for(main(), WAIT_S))[1] == (frames.RESULT, bytes(body))


def test_link_messages_survive_any_split() -> None:
    parts = [
        *linkframes.call_message(7, '{"id": "x"}', [memoryview(b"ab"), memoryview(b"c" * 300)]),
        linkframes.head_message(7, 409, "not_deployed", b"{}"),
        linkframes.header(linkframes.END, 7, 0),
    ]
    data = b"".join(bytes(p) for p in parts)
    for step in (1, 5, 13, len(data)):
        reader = linkframes.Reader()
        got = [
            (kind, stream, bytes(payload))
            for i in range(0, len(data), step)
            for kind, stream, payload in reader.feed(data[i : i + step])
        ]
        assert [g[:2] for g in got] == [
            (linkframes.CALL, 7),
            (linkframes.HEAD, 7),
            (linkframes.END, 7),
        ]
        meta, body = linkframes.split_call(memoryview(got[0][2]))
        assert (meta, bytes(body)) == ('{"id": "x"}', b"ab" + b"c" * 300)
        assert linkframes.split_head(memoryview(got[1][2])) == (409, "not_deployed", b"{}")


def test_an_idle_link_is_closed_by_the_pod_and_the_next_call_opens_another(
    serve: Callable[[Any], Served],
) -> None:
    served = serve(_echo_app([], idle_s=0.2))

    async def main() -> tuple[bytes, bytes, bool]:
        pool = PeerPool(AUTH, tls=served.context)
        async with linkclient.post(
            pool, served.url, "/call", {CALL_HEADER: "a"}, memoryview(b"one")
        ) as resp:
            first = (await _frames(resp))[1][1]
        link = pool.links[next(iter(pool.links))]
        await link.wait_closed(WAIT_S)  # the pod closes it once idle: no sleep here
        closed = link.lost
        async with linkclient.post(
            pool, served.url, "/call", {CALL_HEADER: "b"}, memoryview(b"two")
        ) as resp:
            second = (await _frames(resp))[1][1]
        assert pool.links[next(iter(pool.links))] is not link
        await pool.aclose()
        return first, second, closed

    assert asyncio.run(asyncio.wait_for(main(), WAIT_S)) == (b"one", b"two", True)


def test_a_link_whose_pod_closed_it_before_the_loop_read_it_is_not_fresh() -> None:
    """A pod killed a moment before a call: its FIN is queued on pod 0's link but the loop has
    not read it yet. The quorum check must not trust the link (the call would be written into
    it and count as started): ensure() probes instead, and the gone pod is not reachable."""
    import select
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    answered, close_now = threading.Event(), threading.Event()

    def serve_one() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(linkframes.SWITCH)
            reader = linkframes.Reader()
            calls: list[int] = []
            while not calls:
                calls += [s for k, s, _ in reader.feed(conn.recv(65536)) if k == linkframes.CALL]
            conn.sendall(_answer(calls[0], b"ok"))
            answered.set()
            close_now.wait(WAIT_S)
        listener.close()  # the pod is gone: nothing listens there any more

    server = threading.Thread(target=serve_one, daemon=True)
    server.start()

    async def main() -> tuple[bool, bool]:
        pool = PeerPool(AUTH)
        try:
            async with linkclient.post(
                pool, url, "/call", {CALL_HEADER: "a"}, memoryview(b"")
            ) as resp:
                assert await _frames(resp) == [(frames.RESULT, b"ok")]
            fresh_before = pool.fresh(url)
            link = pool.links[next(iter(pool.links))]
            close_now.set()
            server.join(WAIT_S)
            # wait for the FIN without running the loop (which would read it)
            fd = link.transport.get_extra_info("socket").fileno()
            assert select.select([fd], [], [], WAIT_S)[0], "the pod's close never arrived"
            fresh_after = pool.fresh(url)
            with pytest.raises(PeerConnectError):
                await pool.ensure(url, 2.0)
            return fresh_before, fresh_after
        finally:
            await pool.aclose()

    assert asyncio.run(asyncio.wait_for(main(), WAIT_S)) == (True, False)
