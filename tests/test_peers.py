"""The pod-to-pod client: keep-alive reuse, and silence noticed instead of waited out."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

from ktlite_server.peers import PeerConnectError, PeerError, PeerPool, PeerTimeout


async def _serve(handler) -> tuple[asyncio.AbstractServer, str]:
    async def closing(reader, writer):
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(closing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _stop(server: asyncio.AbstractServer) -> None:
    server.close()
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        task.cancel()  # handlers still sleeping
    await asyncio.sleep(0.05)  # let closed transports finish before the loop goes


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    return await reader.readexactly(length)


def test_chunked_response_and_connection_reuse() -> None:
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            await writer.drain()

    async def main() -> list[bytes]:
        server, url = await _serve(handler)
        pool = PeerPool()
        got = []
        for i in range(3):
            async with pool.post(url, "/call", {}, memoryview(b"hello %d" % i)) as resp:
                got.append(await resp.read())
        await pool.aclose()
        await _stop(server)
        return got

    assert asyncio.run(main()) == [b"hello 0", b"hello 1", b"hello 2"]
    assert connections == 1


def test_silent_peer_times_out_instead_of_hanging() -> None:
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # then nothing: no heartbeat, no end

    async def main() -> float:
        server, url = await _serve(handler)
        pool = PeerPool()
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            async with pool.post(url, "/call", {}, memoryview(b"x"), read_timeout=0.5) as resp:
                async for _ in resp.iter_chunks():
                    pass
        elapsed = time.monotonic() - start
        await pool.aclose()
        await _stop(server)
        return elapsed

    assert asyncio.run(main()) < 3


def test_a_peer_silent_before_its_response_head_times_out_on_a_reused_connection() -> None:
    """The head's wait is bounded too, and a silent peer is not sent the request again (a
    stale keep-alive connection is: nothing was processed there)."""
    requests = []

    async def handler(reader, writer):
        while True:
            await _read_request(reader)
            requests.append(1)
            if len(requests) == 1:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
            else:
                await asyncio.sleep(30)  # read the request, never answer

    async def main() -> None:
        server, url = await _serve(handler)
        pool = PeerPool()
        async with pool.post(url, "/call", {}, memoryview(b"x")) as resp:
            assert await resp.read() == b"ok"
        with pytest.raises(PeerTimeout, match="sent no response for 0.3s"):
            async with pool.post(url, "/call", {}, memoryview(b"y"), read_timeout=0.3):
                pass
        await pool.aclose()
        await _stop(server)

    asyncio.run(main())
    assert len(requests) == 2


def test_a_pooled_connection_the_peer_closed_is_not_reused_on_uvloop() -> None:
    """The pod server's loop (uvloop) raises on a write to a closed transport: a pooled
    connection the peer reset meanwhile must be dropped, and the request sent on a new one."""
    uvloop = pytest.importorskip("uvloop")
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if len(connections) == 1:  # the first connection: reset once answered
            linger = struct.pack("ii", 1, 0)  # close with a reset, as a killed process's
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            writer.transport.abort()

    async def main() -> list[bytes]:
        server, url = await _serve(handler)
        pool = PeerPool()
        got = []
        try:
            async with pool.post(url, "/call", {}, memoryview(b"x")) as resp:
                got.append(await resp.read())
            (pooled,) = [c for conns in pool._idle.values() for c in conns]
            with pytest.raises(ConnectionResetError):  # the reset arrived: the transport closed
                await asyncio.wait_for(pooled.writer.wait_closed(), 10)
            async with pool.post(url, "/call", {}, memoryview(b"y")) as resp:
                got.append(await resp.read())
        finally:
            await pool.aclose()
            await _stop(server)
        return got

    assert uvloop.run(main()) == [b"ok", b"ok"]
    assert len(connections) == 2


def test_unreachable_peer_is_a_connect_error() -> None:
    async def main() -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, never listening: refused
            with pytest.raises(PeerConnectError):
                async with PeerPool().post(
                    f"http://127.0.0.1:{port}", "/call", {}, memoryview(b"")
                ):
                    pass

    asyncio.run(main())


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    await reader.readexactly(length)
    return head


def test_short_requests_carry_the_pool_headers_and_reuse_the_connection() -> None:
    """GET /health and POST /cancel go through the same pool as calls, with the token."""
    heads: list[bytes] = []
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        while True:
            try:
                heads.append(await _read_head(reader))
            except asyncio.IncompleteReadError:
                return
            body = b'{"engine_failed": null, "pod": "p-1"}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def main() -> tuple[object, int]:
        server, url = await _serve(handler)
        pool = PeerPool({"x-ktlite-token": "Bearer sekrit"})
        assert "sekrit" not in repr(pool)
        health = await pool.get_json(f"{url}/health", timeout=5)
        status, _ = await pool.request(
            "POST", f"{url}/cancel/c1", params={"kind": "timeout", "reason": "a b"}, timeout=5
        )
        await pool.aclose()
        await _stop(server)
        return health, status

    health, status = asyncio.run(main())
    assert health == {"engine_failed": None, "pod": "p-1"} and status == 200
    assert connections == 1
    assert (
        heads[0].startswith(b"GET /health HTTP/1.1\r\n")
        and b"x-ktlite-token: Bearer sekrit" in heads[0]
    )
    assert heads[1].startswith(b"POST /cancel/c1?kind=timeout&reason=a+b HTTP/1.1\r\n")
    assert b"x-ktlite-token: Bearer sekrit" in heads[1]


def test_short_request_failures_are_peer_errors() -> None:
    """A silent peer is a PeerTimeout (also a TimeoutError), one that answers garbage or
    closes mid-answer a PeerError: no asyncio or OSError type leaks out of peers.py."""

    async def silent(reader, writer):
        await _read_head(reader)
        await asyncio.sleep(30)

    async def garbage(reader, writer):
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\nshort")
        await writer.drain()

    async def not_json(reader, writer):
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc")
        await writer.drain()

    async def main() -> list[type[BaseException]]:
        got = []
        for handler, call in ((silent, "request"), (garbage, "request"), (not_json, "get_json")):
            server, url = await _serve(handler)
            pool = PeerPool()
            try:
                if call == "request":
                    await pool.request("GET", f"{url}/health", timeout=0.5)
                else:
                    await pool.get_json(f"{url}/health", timeout=5)
            except Exception as e:  # noqa: BLE001 - the type is what is checked
                got.append(type(e))
            await pool.aclose()
            await _stop(server)
        return got

    got = asyncio.run(main())
    assert got[0] is PeerTimeout and issubclass(PeerTimeout, TimeoutError)
    assert all(issubclass(t, PeerError) for t in got), got


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_peer_that_closed_before_the_loop_read_it_is_not_fresh(loop: str) -> None:
    """A pod killed a moment before a call: its FIN is queued on pod 0's pooled connection but
    the loop has not read it yet. The quorum check must not trust that connection (the call
    would be written into it and count as started), and ensure() must probe instead."""
    import select
    import threading

    run = pytest.importorskip("uvloop").run if loop == "uvloop" else asyncio.run
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    answered, close_now = threading.Event(), threading.Event()

    def serve_one() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            answered.set()
            close_now.wait(10)
        listener.close()  # the pod is gone: nothing listens there any more

    server = threading.Thread(target=serve_one, daemon=True)
    server.start()

    async def main() -> tuple[bool, bool]:
        pool = PeerPool()
        try:
            async with pool.post(url, "/call", {}, memoryview(b"x")) as resp:
                assert await resp.read() == b"ok"
            fresh_before = pool.fresh(url)
            (pooled,) = [c for conns in pool._idle.values() for c in conns]
            close_now.set()
            server.join(10)
            # wait for the FIN without running the loop (which would read it)
            fd = pooled.writer.get_extra_info("socket").fileno()
            assert select.select([fd], [], [], 10)[0], "the peer's close never arrived"
            fresh_after = pool.fresh(url)
            with pytest.raises(PeerConnectError):
                await pool.ensure(url, 2.0)
            return fresh_before, fresh_after
        finally:
            await pool.aclose()

    assert run(main()) == (True, False)


def test_a_failed_stale_connection_is_retried_on_a_new_one_not_another_pooled_one() -> None:
    """Two idle connections to a pod that is gone, neither showing it yet: the first fails
    before any answer (nothing was processed: retried), and the retry must not take the
    second, as stale, whose failure would read as a call lost mid-way. On a new connection
    the gone pod refuses: a connect error, which the coordinator reports as not started."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    both_answered = threading.Barrier(3)  # the two connections' threads and the acceptor
    gone = threading.Event()

    def read_request(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        return data

    def serve(conn: socket.socket) -> None:
        with conn:
            read_request(conn)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            both_answered.wait(10)
            if read_request(conn):  # the next request: the pod dies with it unanswered
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def accept_two() -> None:
        threads = [threading.Thread(target=serve, args=(listener.accept()[0],)) for _ in (0, 1)]
        for t in threads:
            t.start()
        both_answered.wait(10)
        listener.close()  # nothing listens any more: a new connection is refused
        gone.set()
        for t in threads:
            t.join(10)

    acceptor = threading.Thread(target=accept_two, daemon=True)
    acceptor.start()

    async def main() -> None:
        pool = PeerPool()

        async def one() -> bytes:
            async with pool.post(url, "/call", {}, memoryview(b"x")) as resp:
                return await resp.read()

        try:
            assert await asyncio.gather(one(), one()) == [b"ok", b"ok"]
            assert sum(len(c) for c in pool._idle.values()) == 2
            assert await asyncio.get_running_loop().run_in_executor(None, gone.wait, 10)
            with pytest.raises(PeerConnectError):
                await one()
        finally:
            await pool.aclose()

    asyncio.run(main())
    acceptor.join(10)
