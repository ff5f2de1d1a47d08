"""A flat fan-out's members reached with a lean ``RUN`` over their peer link (issue 26, item 4:
``ktlite_server.memberrun`` on the member, ``memberanswer`` on pod 0): the messages, a real
pod server's refusal read as its ranks' outcomes, and when a ``RUN`` is sent again (only on a
link whose pod said ``GOAWAY`` before answering it) or not (a pod that died with it).

The servers are real (uvicorn with the pod server's app and protocol); a hand-written peer
where a test needs one that misbehaves. The calls of real deployments over this path are the
fan-out tests' (``tests/test_calltree.py``, ``tests/faults/``)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from served_app import Served

from ktlite_server import linkclient, memberanswer
from ktlite_server.app import create_app
from ktlite_server.connections import Limits
from ktlite_server.peers import PeerPool
from ktlite_server.pod import Pod
from ktlite_wire import frames, linkframes
from ktlite_wire.headers import CALL_HEADER, TOKEN_HEADER, VERSION_HEADER
from ktlite_wire.outcome import RankOutcome, ShmRef
from ktlite_wire.status import Status
from ktlite_wire.version import PROTOCOL_VERSION

TOKEN = "member-run-test-token"
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


def test_run_and_done_messages_survive_any_split() -> None:
    fields = linkframes.run_fields("call-1", "launch-7", 3, 29501, True, False, True)
    outcomes = [
        RankOutcome(4, "pod-1", Status.OK, b"\x80value", "", 0.0),
        RankOutcome(5, "pod-1", Status.ERROR, b"exception info", "it raised", 12.5),
        RankOutcome(6, "pod-1", Status.OK, ShmRef("/dev/shm/ktlite-r-1", 1 << 20), "", 0.0),
        RankOutcome(7, "pod-1", Status.CANCELLED, None, "stopped because rank 5 failed", 13.0),
    ]
    parts = [
        *linkframes.run_message(9, fields, [memoryview(b"args"), memoryview(b"x" * 300)]),
        *linkframes.done_message(9, "pod-1", outcomes),
        linkframes.header(linkframes.GOAWAY, 0, 0),
    ]
    data = b"".join(bytes(p) for p in parts)
    for step in (1, 7, 64, len(data)):
        reader = linkframes.Reader()
        got = [
            (kind, stream, bytes(payload))
            for i in range(0, len(data), step)
            for kind, stream, payload in reader.feed(data[i : i + step])
        ]
        assert [g[:2] for g in got] == [
            (linkframes.RUN, 9),
            (linkframes.DONE, 9),
            (linkframes.GOAWAY, 0),
        ]
        run = linkframes.split_run(memoryview(got[0][2]))
        assert run[:5] == ("call-1", "launch-7", linkframes.STREAM_LOGS | 4, 3, 29501)
        assert bytes(run.body) == b"args" + b"x" * 300
        done = linkframes.read_done(memoryview(got[1][2]))
        assert [(o.rank, o.pod, o.status, o.message) for o in done] == [
            (o.rank, o.pod, o.status, o.message) for o in outcomes
        ]
        assert [bytes(o.data) if type(o.data) is memoryview else o.data for o in done] == [
            o.data for o in outcomes
        ]
        assert [o.at for o in done] == [0.0, 12.5, 0.0, 13.0]  # a value's time is not sent


class _Failed:
    """The coordinator's side of a failed member: records what it was told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, Status, bool]] = []

    def __call__(self, message: str, status: Status, lost: bool) -> list[RankOutcome]:
        self.told.append((message, status, lost))
        return [RankOutcome(1, "pod-1", status, None, message, time.time())]


async def _never_again() -> list[RankOutcome]:
    raise AssertionError("the call was sent again")


class _Sent(asyncio.Future[Any]):
    """The coordinator's side of one RUN: the answer its sink got (``MemberAnswer``)."""

    answer: memberanswer.MemberAnswer

    def sink(self, answer: Any) -> None:
        assert not self.done(), "the answer came twice"
        self.set_result(answer)


def _run_sent(
    pool: PeerPool,
    url: str,
    failed: _Failed,
    again: Any = _never_again,
    call_id: str = "c1",
    body: memoryview | None = None,
    silence_s: float = 3600.0,
    emit: Any = lambda frame: None,
) -> _Sent:
    fields = linkframes.run_fields(call_id, "", 0, None, True, False, False)
    if body is None:
        body = memoryview(b"".join(bytes(p) for p in _noop_body()))
    sent = _Sent()
    answer = memberanswer.send(
        pool, url, "pod-1", fields, body, silence_s, emit, failed, again, sent.sink
    )
    assert answer is not None, "no open link: the RUN was not sent"
    sent.answer = answer
    return sent


def _send(
    pool: PeerPool, url: str, failed: _Failed, again: Any = _never_again, call_id: str = "c1"
) -> _Sent:
    return _run_sent(pool, url, failed, again, call_id)


def _noop_body() -> list[Any]:
    from ktlite.net import packaging

    return list(packaging.encode_call(None, (), {}))


async def _open_link(pool: PeerPool, url: str) -> None:
    """The pool's link to ``url``, opened by a call (refused or not: the link stays)."""
    meta = json.dumps({"id": "opener", "fanout": False})
    async with linkclient.post(pool, url, "/call", {CALL_HEADER: meta}, memoryview(b"")) as resp:
        await resp.read()
    assert len(pool.links) == 1


def test_a_pod_without_code_refuses_a_run_and_its_ranks_are_stale(
    serve: Callable[[Any], Served],
) -> None:
    served = serve(create_app(Pod("pod-1", 1), TOKEN))

    async def main() -> list[RankOutcome]:
        pool = PeerPool(AUTH, tls=served.context)
        await _open_link(pool, served.url)
        failed = _Failed()
        outs = await asyncio.wait_for(_send(pool, served.url, failed), WAIT_S)
        assert len(failed.told) == 1 and not failed.told[0][2]  # refused: not a lost pod
        await pool.aclose()
        return outs

    (out,) = asyncio.run(main())
    assert out.status is Status.STALE
    assert "answered HTTP 409" in out.message and "has no code deployed" in out.message


def test_a_pod_that_closes_an_idle_link_says_goaway_first() -> None:
    served = Served(
        create_app(Pod("pod-1", 1), TOKEN, limits=Limits(idle_timeout=0.2)), None, TOKEN
    )
    try:
        with socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S) as sock:
            head = ["POST /link HTTP/1.1", "host: x", "content-length: 0"]
            head += [f"{k}: {v}" for k, v in AUTH.items()]
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
            data = b""
            while chunk := sock.recv(4096):  # until the pod closes it, idle
                data += chunk
    finally:
        served.stop()
    assert data.startswith(linkframes.SWITCH)
    got = list(linkframes.Reader().feed(data[len(linkframes.SWITCH) :]))
    assert [(kind, stream) for kind, stream, _ in got] == [(linkframes.GOAWAY, 0)]


class _Peer:
    """A hand-written pod: answers link requests; ``script(stream, writer)`` answers each RUN
    (the link's first). Counts the links opened."""

    def __init__(self, script: Callable[[int, asyncio.StreamWriter], Any]) -> None:
        self.script = script
        self.links = 0
        self.runs = 0
        self.on_close: Callable[[int], None] = lambda stream: None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.links += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(linkframes.SWITCH)
        parse = linkframes.Reader()
        try:
            while data := await reader.read(1 << 16):
                for kind, stream, _ in parse.feed(data):
                    if kind == linkframes.CALL:  # the call that opened the link
                        writer.write(linkframes.head_message(stream, 409, "not_deployed", b"{}"))
                    elif kind == linkframes.RUN:
                        self.runs += 1
                        await self.script(stream, writer)
                    elif kind == linkframes.CLOSE:
                        self.on_close(stream)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def start(self) -> tuple[asyncio.AbstractServer, str]:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _done(stream: int, value: bytes) -> bytes:
    out = RankOutcome(1, "pod-1", Status.OK, value, "", 0.0)
    return b"".join(bytes(p) for p in linkframes.done_message(stream, "pod-1", [out]))


def test_a_run_on_a_link_whose_pod_said_goaway_is_sent_again() -> None:
    async def script(stream: int, writer: asyncio.StreamWriter) -> None:
        writer.write(linkframes.header(linkframes.GOAWAY, 0, 0))  # closing it, idle
        await writer.drain()
        writer.close()

    async def main() -> tuple[list[RankOutcome], list[Any], int, int]:
        peer = _Peer(script)
        server, url = await peer.start()
        pool = PeerPool(AUTH)
        await _open_link(pool, url)
        failed = _Failed()
        sent_again: list[RankOutcome] = [RankOutcome(1, "pod-1", Status.OK, b"again", "", 0.0)]

        async def again() -> list[RankOutcome]:
            return sent_again

        outs = await asyncio.wait_for(_send(pool, url, failed, again), WAIT_S)
        await pool.aclose()
        server.close()
        return outs, failed.told, peer.runs, peer.links

    outs, told, runs, links = asyncio.run(main())
    assert [bytes(o.data) for o in outs] == [b"again"]
    assert told == [] and runs == 1 and links == 1


def test_a_run_whose_pod_died_with_it_fails_at_once_and_is_not_sent_again() -> None:
    async def script(stream: int, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()  # the pod is gone mid-call, without a GOAWAY

    async def main() -> tuple[list[RankOutcome], list[Any]]:
        peer = _Peer(script)
        server, url = await peer.start()
        pool = PeerPool(AUTH)
        await _open_link(pool, url)
        failed = _Failed()
        outs = await asyncio.wait_for(_send(pool, url, failed), WAIT_S)
        await pool.aclose()
        server.close()
        return outs, failed.told

    outs, told = asyncio.run(main())
    assert len(told) == 1
    message, status, lost = told[0]
    assert status is Status.DIED and lost
    assert "lost the connection to pod pod-1 during the call" in message
    assert outs[0].status is Status.DIED


def test_a_runs_log_frames_reach_the_caller_and_its_done_its_outcomes() -> None:
    async def script(stream: int, writer: asyncio.StreamWriter) -> None:
        log = frames.log_frame(1, "pod-1", "stdout", "hello from rank 1")
        writer.write(linkframes.header(linkframes.DATA, stream, len(log)) + log)
        await writer.drain()
        writer.write(_done(stream, b"value of rank 1"))
        await writer.drain()

    async def main() -> tuple[list[RankOutcome], list[Any], list[Any]]:
        peer = _Peer(script)
        server, url = await peer.start()
        pool = PeerPool(AUTH)
        await _open_link(pool, url)
        failed = _Failed()
        emitted: list[Any] = []
        sent = _run_sent(pool, url, failed, body=memoryview(b""), emit=emitted.append)
        outs = await asyncio.wait_for(sent, WAIT_S)
        await pool.aclose()
        server.close()
        return outs, failed.told, emitted

    outs, told, emitted = asyncio.run(main())
    assert told == []
    assert [(o.rank, o.status, bytes(o.data)) for o in outs] == [(1, Status.OK, b"value of rank 1")]
    (log,) = [d for k, d in frames.FrameParser().feed(b"".join(emitted)) if k == frames.LOG]
    assert frames.LogLine.decode(log).text == "hello from rank 1"


def test_a_stopped_run_is_not_waited_for_and_its_stream_is_closed() -> None:
    async def main() -> list[int]:
        got_close: list[int] = []
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(linkframes.SWITCH)
            parse = linkframes.Reader()
            while data := await reader.read(1 << 16):
                for kind, stream, _ in parse.feed(data):
                    if kind == linkframes.CALL:
                        writer.write(linkframes.head_message(stream, 409, "x", b"{}"))
                    elif kind == linkframes.CLOSE:
                        got_close.append(stream)
                        done.set()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = PeerPool(AUTH)
        await _open_link(pool, url)
        sent = _send(pool, url, _Failed())
        sent.answer.cancel()  # the coordinator stopped waiting (its stop's grace ran out)
        await asyncio.wait_for(done.wait(), WAIT_S)
        await pool.aclose()
        server.close()
        return got_close

    assert asyncio.run(main()) == [2]  # the RUN's stream (the opening call was 1)


def test_links_whose_pods_hung_up_are_stale_all_asked_at_once() -> None:
    """A pod killed a moment before a call: its FIN (or reset) is queued on pod 0's link, the
    loop has not read it yet. The quorum's check of every link at once (one poll) must not
    trust that link, and must trust the others."""
    import select

    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in listeners]

    async def main() -> tuple[list[int], list[int]]:
        loop = asyncio.get_running_loop()
        pool = PeerPool(AUTH)
        conns = []
        try:
            for listener, url in zip(listeners, urls, strict=True):
                opened = asyncio.ensure_future(_link(pool, url))
                conn, _ = await loop.run_in_executor(None, listener.accept)
                conns.append(conn)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await loop.run_in_executor(None, conn.recv, 65536)
                conn.sendall(linkframes.SWITCH)
                await asyncio.wait_for(opened, WAIT_S)
            for link in pool.links.values():
                link.used = time.monotonic()  # as if each just carried an answer
            before = pool.stale(urls)
            conns[1].close()  # the second pod is gone
            conns[2].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conns[2].close()  # the third one's end is reset
            for k in (1, 2):  # its close arrives, without running the loop (which would read it)
                fd = pool.links[urls[k].removeprefix("http://")].transport.get_extra_info("socket")
                assert select.select([fd.fileno()], [], [], WAIT_S)[0], "the close never arrived"
            return before, pool.stale(urls)
        finally:
            for c in conns:
                c.close()
            await pool.aclose()

    try:
        assert asyncio.run(main()) == ([], [1, 2])
    finally:
        for s in listeners:
            s.close()


async def _link(pool: PeerPool, url: str) -> None:
    host, port, https = linkclient._address(url)
    await linkclient._connect(pool, f"{host}:{port}", host, port, https, WAIT_S)


def test_a_silent_member_is_given_up_by_the_links_watch_and_its_stream_closed() -> None:
    """The link watches its RUNs' silence, one timer for all (a member beats for each call it
    runs): a member that sends nothing for the read timeout fails its call, named, the
    stream is closed, and the link carries the next call."""
    got: list[tuple[int, int]] = []

    async def script(stream: int, writer: asyncio.StreamWriter) -> None:
        if stream == 3:  # the second RUN is answered
            writer.write(_done(stream, b"fine"))
            await writer.drain()

    async def main() -> tuple[list[Any], list[RankOutcome], int]:
        peer = _Peer(script)
        peer.on_close = lambda stream: got.append((linkframes.CLOSE, stream))
        server, url = await peer.start()
        pool = PeerPool(AUTH)
        await _open_link(pool, url)
        failed = _Failed()

        def send(call_id: str, silence_s: float) -> asyncio.Future[Any]:
            return _run_sent(pool, url, failed, body=memoryview(b""), silence_s=silence_s)

        await asyncio.wait_for(send("silent", 0.3), WAIT_S)
        fine = await asyncio.wait_for(send("second", 3600.0), WAIT_S)
        await pool.aclose()
        server.close()
        return failed.told, fine, peer.links

    told, fine, links = asyncio.run(main())
    assert len(told) == 1
    message, status, lost = told[0]
    assert "stopped responding (no data or heartbeat for 0.3s)" in message
    assert status is Status.DIED and lost
    assert [bytes(o.data) for o in fine] == [b"fine"]
    assert links == 1 and got == [(linkframes.CLOSE, 2)]
