"""Pod 0 forwards a large call body to the other pods (issue 26, item 5) a piece at a time:
a post fails at once when its pod goes mid-body, and holds one piece at a time for a pod that
reads slowly. Real sockets: the other pod is a small asyncio server; then real pods of the
local backend, pod 1 behind a relay that cuts its connection mid-body.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from urllib.parse import urlsplit

import numpy as np
import pytest
from tcp_relay import Relay

import ktlite as kt
from ktlite_server import peers
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


def test_a_pod_that_goes_mid_body_fails_the_post() -> None:
    size = 64 * MB

    async def member(reader, writer):
        await _read_head(reader)
        await reader.readexactly(MB)
        writer.transport.abort()  # the pod dies one MiB in

    async def main() -> None:
        server, url = await _serve(member)
        pool = PeerPool()
        with pytest.raises(PeerError):
            async with pool.post(url, "/call", {}, memoryview(bytes(size))):
                pass
        await pool.aclose()
        server.close()

    asyncio.run(asyncio.wait_for(main(), WAIT_S))


def test_a_pod_that_stops_reading_fails_the_post_after_its_silence() -> None:
    """A pod that takes no more of the body (hung, or behind a dead link) fails the post once
    the read timeout passes: before, the post waited on the connection's drain for ever."""

    async def member(reader, writer):
        await _read_head(reader)
        try:
            await asyncio.sleep(WAIT_S)  # reads nothing more
        finally:
            writer.close()

    async def main() -> None:
        server, url = await _serve(member)
        pool = PeerPool()
        with pytest.raises(PeerError, match="took no more of the body"):
            body = memoryview(bytes(64 * MB))
            async with pool.post(url, "/call", {}, body, read_timeout=0.5):
                pass
        await pool.aclose()
        server.close()
        for t in asyncio.all_tasks() - {asyncio.current_task()}:
            t.cancel()  # the member still sleeping
        await asyncio.sleep(0)

    asyncio.run(main())  # the post itself waits 0.5 s for the pod to take more


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
        task = asyncio.ensure_future(
            peers._write_body(writer, [memoryview(bytes(size))], WAIT_S, "member")
        )
        for _ in range(50):  # the kernel's buffers fill; the write waits on the drain
            await asyncio.sleep(0.01)
            high = writer.transport.get_write_buffer_limits()[1]  # drain() waits below it
            queued.append(writer.transport.get_write_buffer_size() - high)
        assert not task.done()
        task.cancel()
        writer.transport.abort()
        server.close()
        for t in asyncio.all_tasks() - {asyncio.current_task()}:
            t.cancel()  # the member still sleeping
        await asyncio.sleep(0)

    asyncio.run(main())
    assert max(queued) <= peers.WRITE_PIECE


# ---- real pods: pod 0 forwards to pod 1 through a relay that cuts the connection ------------


def size_of(x: np.ndarray) -> int:
    return int(x.nbytes)


class CuttingRelay(Relay):
    """A relay that cuts every connection once ``cut_after`` bytes went one way through it."""

    def __init__(self, target_port: int, cut_after: int) -> None:
        self.cut_after = cut_after
        super().__init__(target_port)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        passed = 0
        try:
            while passed < self.cut_after:
                data = src.recv(1 << 16)
                if not data:
                    break
                passed += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # the pod behind it is gone, mid-body
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def test_a_pod_cut_off_mid_body_fails_the_call_naming_it(monkeypatch) -> None:
    monkeypatch.setenv("KTLITE_SHM", "0")  # the body over HTTP, forwarded by pod 0
    remote = kt.fn(size_of, name="fwd-cut").to(
        kt.Compute(stream_logs=False).distribute("spmd", workers=2)
    )
    try:
        x = np.ones(12 << 20, dtype=np.float32)  # 48 MiB
        assert remote(x) == [x.nbytes, x.nbytes]
        dep = remote.deployment
        eps = list(dep.applied.endpoints)
        relay = CuttingRelay(urlsplit(eps[1].peer_url).port or 0, cut_after=8 * MB)
        try:
            scheme = urlsplit(eps[1].peer_url).scheme
            dep.applied.endpoints = [
                eps[0],
                dataclasses.replace(eps[1], peer_url=f"{scheme}://127.0.0.1:{relay.port}"),
            ]
            with pytest.raises(kt.RemoteError) as failed:
                remote(x)
        finally:
            dep.applied.endpoints = eps
            relay.close()
        assert eps[1].name in str(failed.value) and "connection" in str(failed.value)
        assert remote(x) == [x.nbytes, x.nbytes]  # the deployment goes on
    finally:
        remote.teardown()
