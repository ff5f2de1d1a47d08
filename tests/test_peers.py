"""The pod-to-pod client: keep-alive reuse, and silence noticed instead of waited out."""

from __future__ import annotations

import asyncio
import time

import pytest

from ktlite_server.peers import PeerConnectError, PeerPool


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
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
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


def test_unreachable_peer_is_a_connect_error() -> None:
    async def main() -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, never listening: refused
            with pytest.raises(PeerConnectError):
                async with PeerPool().post(f"http://127.0.0.1:{port}", "/call", {}, memoryview(b"")):
                    pass

    asyncio.run(main())
