"""Pod 0 forwards a large call body to the other pods as it lands (issue 26, item 5): a
post sends each piece once it is there, stops when the body is cut, fails at once when its
pod goes, and holds one piece at a time for a pod that reads slowly. Real sockets: the other
pod is a small asyncio server; the body an ``arriving.Arriving`` fed as a connection would.
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from ktlite_server import peers
from ktlite_server.arriving import Arriving
from ktlite_server.peers import PeerError, PeerPool

MB = 1 << 20
WAIT_S = 30.0  # a bound on every wait: a broken test fails, never hangs


async def _serve(handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_head(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    return next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )


def _ok(writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def test_a_post_sends_each_piece_once_it_lands() -> None:
    body = bytes(range(256)) * (8 * MB // 256)
    got = bytearray()
    reached = asyncio.Event()
    first = 3 * MB + 5

    async def member(reader, writer):
        n = await _read_head(reader)
        while len(got) < n:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            got.extend(chunk)
            if len(got) >= first:
                reached.set()
        _ok(writer, b"done")
        await writer.drain()
        writer.close()

    async def main() -> bytes:
        server, url = await _serve(member)
        arriving = Arriving(len(body))
        arriving.add(first)  # only this much has landed
        pool = PeerPool()

        async def post() -> bytes:
            async with pool.post(url, "/call", {}, memoryview(body), arriving=arriving) as r:
                return await r.read()

        task = asyncio.ensure_future(post())
        # the other pod has the bytes that landed while the rest is still on its way
        await asyncio.wait_for(reached.wait(), WAIT_S)
        assert len(got) == first and not task.done()
        arriving.add(len(body) - first)
        answer = await asyncio.wait_for(task, WAIT_S)
        await pool.aclose()
        server.close()
        return answer

    assert asyncio.run(main()) == b"done"
    assert bytes(got) == body


def test_a_body_cut_short_cuts_the_post_mid_body() -> None:
    size = 6 * MB
    seen: list[int] = []

    async def member(reader, writer):
        n = await _read_head(reader)
        total = 0
        while total < n:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            total += len(chunk)
        seen.append(total)
        writer.close()

    async def main() -> None:
        server, url = await _serve(member)
        arriving = Arriving(size)
        arriving.add(2 * MB)
        pool = PeerPool()

        async def post() -> None:
            async with pool.post(url, "/call", {}, memoryview(bytes(size)), arriving=arriving):
                pass

        task = asyncio.ensure_future(post())
        await asyncio.sleep(0)  # the post is on its way and waits for more of the body
        arriving.fail(ClientDisconnect())
        with pytest.raises(ClientDisconnect):
            await asyncio.wait_for(task, WAIT_S)
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not seen and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        server.close()

    asyncio.run(main())
    assert seen and seen[0] < size  # the other pod got a cut body: it runs nothing


def test_a_pod_that_goes_mid_body_fails_the_post() -> None:
    size = 64 * MB

    async def member(reader, writer):
        await _read_head(reader)
        await reader.readexactly(MB)
        writer.transport.abort()  # the pod dies one MiB in

    async def main() -> None:
        server, url = await _serve(member)
        arriving = Arriving(size)
        arriving.add(size)
        pool = PeerPool()
        with pytest.raises(PeerError):
            async with pool.post(url, "/call", {}, memoryview(bytes(size)), arriving=arriving):
                pass
        await pool.aclose()
        server.close()

    asyncio.run(asyncio.wait_for(main(), WAIT_S))


def test_a_slow_pod_is_given_one_piece_at_a_time() -> None:
    """A pod that does not read: the body is not handed to its connection whole (a TLS one
    would encrypt all of it into memory), one piece at a time after each drain."""
    size = 64 * MB
    queued: list[int] = []

    async def member(reader, writer):
        try:
            await asyncio.sleep(WAIT_S)  # reads nothing
        finally:
            writer.close()

    async def main() -> None:
        server, url = await _serve(member)
        _, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        task = asyncio.ensure_future(peers._write_body(writer, [memoryview(bytes(size))], None))
        for _ in range(50):  # the kernel's buffers fill; the write waits on the drain
            await asyncio.sleep(0.01)
            queued.append(writer.transport.get_write_buffer_size())
        assert not task.done()
        task.cancel()
        writer.transport.abort()
        server.close()
        for t in asyncio.all_tasks() - {asyncio.current_task()}:
            t.cancel()  # the member still sleeping
        await asyncio.sleep(0)

    asyncio.run(main())
    assert max(queued) <= peers.WRITE_PIECE
