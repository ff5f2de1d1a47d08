"""A coordinator stops a call on the pods it sent it to with a ``STOP`` on their peer link
(``linkframes.STOP``), not a ``POST /cancel`` each: the message, a real pod server acting on
it as on ``POST /cancel`` (a stop that overtakes its call keeps it from starting), a malformed
one closing the link, and pod 0's stop reaching a member over its open link with no request.

What a stop does to running ranks, through relays and with pods that died, is the fault
tests' (``tests/faults/test_tree.py``, ``tests/faults/test_pod_death.py``)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from served_app import Served

from ktlite_server import linkclient
from ktlite_server.app import create_app
from ktlite_server.coordinator import Coordinator
from ktlite_server.peers import PeerPool
from ktlite_server.pod import Pod
from ktlite_wire import linkframes
from ktlite_wire.errors import ProtocolError
from ktlite_wire.headers import CALL_HEADER, TOKEN_HEADER, VERSION_HEADER
from ktlite_wire.plan import CallPlan
from ktlite_wire.status import Status
from ktlite_wire.version import PROTOCOL_VERSION

TOKEN = "link-stop-test-token"
WAIT_S = 30.0  # a guard against a hang; every answer here takes milliseconds
AUTH = {TOKEN_HEADER: f"Bearer {TOKEN}", VERSION_HEADER: str(PROTOCOL_VERSION)}


def test_a_stop_message_survives_any_split_and_garbage_is_refused() -> None:
    stop = linkframes.Stop("call-7", Status.TIMEOUT, "the call ran past its timeout", True)
    data = linkframes.stop_message(stop) + linkframes.header(linkframes.GOAWAY, 0, 0)
    for step in (1, 5, len(data)):
        reader = linkframes.Reader()
        got = [m for i in range(0, len(data), step) for m in reader.feed(data[i : i + step])]
        assert [(kind, stream) for kind, stream, _ in got] == [
            (linkframes.STOP, 0),
            (linkframes.GOAWAY, 0),
        ]
        assert linkframes.split_stop(got[0][2]) == stop
    long = linkframes.Stop("c", Status.CANCELLED, "x" * 2000, False)
    (_, _, payload), *_ = linkframes.Reader().feed(linkframes.stop_message(long))
    assert linkframes.split_stop(payload).reason == "x" * linkframes.REASON_MAX
    with pytest.raises(ValueError):  # only a stop's kinds: a call is not stopped as "ok"
        linkframes.stop_message(linkframes.Stop("c", Status.OK, "", False))
    for bad in (b"", b"\x07\x00\x01\x00c", b"\x00\x00\x09\x00c", b"\x00\x02\x01\x00c"):
        with pytest.raises(ProtocolError):
            linkframes.split_stop(memoryview(bad))


def _link_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    head = ["POST /link HTTP/1.1", "host: x", "content-length: 0"]
    head += [f"{k}: {v}" for k, v in AUTH.items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    got = b""
    while len(got) < len(linkframes.SWITCH):
        chunk = sock.recv(len(linkframes.SWITCH) - len(got))
        assert chunk, "the pod closed the link request"
        got += chunk
    assert got == linkframes.SWITCH
    return sock


def test_a_pod_stops_a_call_its_link_says_stop_to_before_it_arrived() -> None:
    pod = Pod("pod-1", 1)
    served = Served(create_app(pod, TOKEN), None, TOKEN)
    try:
        with _link_socket(served.port) as sock:
            stop = linkframes.Stop("early", Status.TIMEOUT, "ran past its timeout of 5s", True)
            sock.sendall(linkframes.stop_message(stop))
            # a call after it on the same link: its refusal (no code here) says the STOP was read
            meta = b'{"id": "probe"}'
            sock.sendall(b"".join(bytes(p) for p in linkframes.call_message(1, meta.decode(), [])))
            data = b""
            while not data or not list(linkframes.Reader().feed(data)):
                chunk = sock.recv(65536)
                assert chunk, "the pod closed the link"
                data += chunk
            (kind, stream, _), *_ = linkframes.Reader().feed(data)
            assert (kind, stream) == (linkframes.HEAD, 1)
        # the stop overtook its call: it never starts there (Pod.run), as after POST /cancel
        assert pod.cancelled_early["early"] == (Status.TIMEOUT, "ran past its timeout of 5s")
        with _link_socket(served.port) as sock:  # a malformed STOP: the link is closed
            sock.sendall(linkframes.header(linkframes.STOP, 0, 5) + b"\x09\x00\x01\x00c")
            assert sock.recv(65536) == b""
        assert set(pod.cancelled_early) == {"early"}
    finally:
        served.stop()


def test_pod_0_stops_a_member_with_a_stop_on_its_open_link() -> None:
    async def main() -> tuple[list[linkframes.Stop], int]:
        stops: list[linkframes.Stop] = []
        stopped = asyncio.Event()
        links = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal links
            links += 1
            await reader.readuntil(b"\r\n\r\n")  # a link request (or, before, a POST /cancel)
            writer.write(linkframes.SWITCH)
            parse = linkframes.Reader()
            while data := await reader.read(1 << 16):
                for kind, stream, payload in parse.feed(data):
                    if kind == linkframes.CALL:  # the call that opened the link
                        writer.write(linkframes.head_message(stream, 409, "not_deployed", b"{}"))
                    elif kind == linkframes.STOP:
                        stops.append(linkframes.split_stop(payload))
                        stopped.set()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = PeerPool(AUTH)
        meta = '{"id": "opener", "fanout": false}'
        async with linkclient.post(pool, url, "/call", {CALL_HEADER: meta}, memoryview(b"")) as r:
            await r.read()
        plan = CallPlan(
            "call-3", pods=["http://127.0.0.1:1", url], names=["pod-0", "pod-1"], fanout=True
        )
        coordinator: Any = Coordinator(Pod("pod-0", 0), TOKEN, pool, plan)
        coordinator._members = [0, 1]
        coordinator.started = True
        coordinator.cancel(Status.CANCELLED, "stopped because rank 0 failed")
        await asyncio.wait_for(stopped.wait(), WAIT_S)
        await pool.aclose()
        server.close()
        return stops, links

    stops, links = asyncio.run(main())
    assert stops == [
        linkframes.Stop("call-3", Status.CANCELLED, "stopped because rank 0 failed", True)
    ]
    assert links == 1  # no connection of its own for the stop
