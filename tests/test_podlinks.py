"""``ktlite.net.podlinks``: calls to a pod reached directly over one persistent link, answers
read on one thread. First against a raw link server in a thread (what a pod's end of a link
does at the byte level: answers out of order, a refusal, a link closed while idle or mid-call,
a stream left silent), then against real pod servers (the token, a call id sent twice)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt
import ktlite.net.client
from ktlite.net import packaging
from ktlite.net.call_reply import FrameReader, answered
from ktlite.net.connection import ConnectionFailed
from ktlite.net.podlinks import LinkMux
from ktlite_wire import linkframes
from ktlite_wire.frames import RESULT, frame
from ktlite_wire.headers import ERROR_CODE_HEADER, TOKEN_HEADER, VERSION_HEADER, bearer
from ktlite_wire.plan import CallPlan
from ktlite_wire.version import PROTOCOL_VERSION

HEADERS = {TOKEN_HEADER: bearer("t"), VERSION_HEADER: str(PROTOCOL_VERSION)}
Serve = Callable[["RawLinks", socket.socket, list[tuple[int, int, bytes]]], bool]


class RawLinks:
    """A raw pod end of links: answers ``POST /link`` with ``refusal`` or ``101``, then hands
    each read's messages to ``serve(server, conn, messages)``, which answers; it returns
    False to close the connection."""

    def __init__(self, serve: Serve, refusal: bytes | None = None) -> None:
        self.serve, self.refusal = serve, refusal
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.links = 0
        self.calls: list[str] = []  # the plan header of each CALL, as it came
        self.closed: list[int] = []  # the streams the caller closed
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            self.links += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            assert head.startswith(b"POST /link?heads=late HTTP/1.1\r\n")
            if self.refusal is not None:
                conn.sendall(self.refusal)
                return
            conn.sendall(linkframes.SWITCH)
            reader = linkframes.Reader()
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                got = []
                for kind, stream, payload in reader.feed(data):
                    if kind == linkframes.CALL:
                        meta, _ = linkframes.split_call(payload)
                        self.calls.append(meta)
                        got.append((kind, stream, meta.encode()))
                    else:
                        self.closed.append(stream)
                if got and not self.serve(self, conn, got):
                    return


def answer(stream: int, value: bytes) -> bytes:
    data = frame(RESULT, value)
    return (
        linkframes.head_message(stream, 200)
        + linkframes.header(linkframes.DATA, stream, len(data))
        + data
        + linkframes.header(linkframes.END, stream, 0)
    )


def start(mux: LinkMux, url: str, meta: str, silence: float = 30.0) -> concurrent.futures.Future:
    """A call over ``mux``; its future ends with (status, headers, body, error, frames)."""
    ended: concurrent.futures.Future = concurrent.futures.Future()
    seen: list = []

    def done(status: int, headers: dict, body: Any, error: BaseException | None) -> None:
        ended.set_result((status, headers, body, error, seen))

    mux.start(
        url, HEADERS, meta, [b"args"], None, silence, lambda k, p: seen.append((k, bytes(p))), done
    )
    return ended


def test_calls_on_one_link_each_get_their_own_answer_in_any_order() -> None:
    def backwards(server: RawLinks, conn: socket.socket, got: list) -> bool:
        pending.extend(got)
        if len(pending) == 3:  # all three in flight at once: answered last first
            conn.sendall(b"".join(answer(s, meta) for _, s, meta in reversed(pending)))
        return True

    pending: list = []
    server = RawLinks(backwards)
    mux = LinkMux()
    futures = [start(mux, server.url, f"call {i}") for i in range(3)]
    for i, f in enumerate(futures):
        status, _, _, error, seen = f.result(timeout=30)
        assert (status, error, seen) == (200, None, [(RESULT, f"call {i}".encode())])
    assert server.links == 1


def test_a_refused_link_is_the_answer_of_every_call_that_waited_for_it() -> None:
    body = b'{"detail": "missing or wrong deployment token"}'
    refusal = (
        b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
        b"x-ktlite-error: unauthorized\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    server = RawLinks(lambda *a: True, refusal=refusal)
    mux = LinkMux()
    for f in [start(mux, server.url, "a"), start(mux, server.url, "b")]:
        status, headers, got, error, _ = f.result(timeout=30)
        assert (status, headers[ERROR_CODE_HEADER], got, error) == (401, "unauthorized", body, None)
    assert server.calls == []


def test_an_idle_link_the_pod_closed_sends_its_call_again_on_a_new_link() -> None:
    def once_per_link(server: RawLinks, conn: socket.socket, got: list) -> bool:
        if len(server.calls) > 1 and served.get(id(conn)):
            return False  # a kept link closed when its next call came: nothing of it ran
        served[id(conn)] = True
        conn.sendall(b"".join(answer(s, meta) for _, s, meta in got))
        return True

    served: dict[int, bool] = {}
    server = RawLinks(once_per_link)
    mux = LinkMux()
    assert start(mux, server.url, "first").result(timeout=30)[3] is None
    status, _, _, error, seen = start(mux, server.url, "second").result(timeout=30)
    assert (status, error, seen) == (200, None, [(RESULT, b"second")])
    assert server.links == 2 and server.calls == ["first", "second", "second"]


def test_a_link_lost_mid_call_fails_each_of_its_calls_and_sends_none_again() -> None:
    def drop(server: RawLinks, conn: socket.socket, got: list) -> bool:
        pending.extend(got)
        if len(pending) < 2:
            return True
        conn.sendall(linkframes.head_message(pending[0][1], 200))  # one had begun, one not
        return False

    pending: list = []
    server = RawLinks(drop)
    mux = LinkMux()
    futures = [start(mux, server.url, "a"), start(mux, server.url, "b")]
    for f in futures:
        error = f.result(timeout=30)[3]
        assert isinstance(error, ConnectionFailed), error
        assert server.url.removeprefix("http://") in str(error)
    assert server.links == 1 and server.calls == ["a", "b"]


def test_a_silent_call_fails_alone_and_its_stream_is_closed() -> None:
    def one_of_two(server: RawLinks, conn: socket.socket, got: list) -> bool:
        for _, stream, meta in got:
            if meta == b"answered":
                conn.sendall(answer(stream, meta))
            else:
                conn.sendall(linkframes.head_message(stream, 200))  # then nothing
        return True

    server = RawLinks(one_of_two)
    mux = LinkMux()
    silent = start(mux, server.url, "silent", silence=1.0)
    ok = start(mux, server.url, "answered", silence=1.0)
    assert ok.result(timeout=30)[3] is None
    error = silent.result(timeout=30)[3]
    assert isinstance(error, TimeoutError) and "no frame and no heartbeat for 1s" in str(error)
    assert start(mux, server.url, "answered").result(timeout=30)[3] is None  # the link lives on
    assert server.closed == [1] and server.links == 1


def once(path: str) -> int:
    with open(Path(path, uuid.uuid4().hex), "w"):
        pass
    return len(os.listdir(path))


@pytest.fixture(scope="module")
def pod():
    remote = kt.fn(once).to(kt.Compute(cpus=1, concurrency=4, stream_logs=False), name="links")
    yield remote
    remote.teardown()


def _address(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port)


def test_submitted_calls_take_one_link_to_their_pod(pod, tmp_path) -> None:
    futures = [pod.submit(str(tmp_path)) for _ in range(20)]
    assert all(f.result(timeout=60) >= 1 for f in futures)
    assert len(os.listdir(tmp_path)) == 20
    address = _address(pod.deployment.endpoints[0].url)
    links = [k for key, k in ktlite.net.client._links._links.items() if key[:2] == address]
    assert len(links) == 1 and not links[0].lost


def _plan(pod, call_id: str) -> str:
    ep = pod.deployment.endpoints[0]
    return CallPlan(
        id=call_id,
        launch_id=pod.deployment.launch_id,
        fanout=True,
        pods=[ep.url],
        names=[ep.name],
        num_proc=1,
        quorum_timeout=10,
        stream_logs=False,
    ).encode()


def _reply(pod, mux: LinkMux, meta: str, parts: list, headers: dict) -> concurrent.futures.Future:
    url = pod.deployment.endpoints[0].url
    ended: concurrent.futures.Future = concurrent.futures.Future()
    frames = FrameReader(None, None, url)

    def done(reply: Any, error: BaseException | None) -> None:
        ended.set_result((reply, error))

    finished = answered(frames, f"pod at {url}", 30.0, done)
    mux.start(url, headers, meta, parts, None, 30.0, frames.frame, finished)
    return ended


def test_a_link_without_the_deployments_token_is_refused(pod) -> None:
    parts = packaging.encode_call(None, ("/nonexistent",), {})
    for token in ("not-the-token", None):
        headers = {VERSION_HEADER: str(PROTOCOL_VERSION)}
        if token is not None:
            headers[TOKEN_HEADER] = bearer(token)
        reply, error = _reply(pod, LinkMux(), _plan(pod, uuid.uuid4().hex), parts, headers).result(
            timeout=60
        )
        assert reply is None and isinstance(error, kt.AuthError), error


def test_a_call_id_sent_twice_over_a_link_runs_once(pod, tmp_path) -> None:
    token = pod.deployment.applied.token
    headers = {TOKEN_HEADER: bearer(token), VERSION_HEADER: str(PROTOCOL_VERSION)}
    meta = _plan(pod, uuid.uuid4().hex)
    parts = packaging.encode_call(None, (str(tmp_path),), {})
    mux = LinkMux()
    first = _reply(pod, mux, meta, parts, headers)
    second = _reply(pod, mux, meta, parts, headers)  # the same id at once, on the same link
    replies = [f.result(timeout=60) for f in (first, second)]
    assert all(error is None for _, error in replies), replies
    values = [json.dumps([bytes(v).hex() for v in reply.values()]) for reply, _ in replies]
    assert values[0] == values[1]
    assert len(os.listdir(tmp_path)) == 1
    third = _reply(pod, LinkMux(), meta, parts, headers).result(timeout=60)  # a new link, later
    assert third[1] is None and len(os.listdir(tmp_path)) == 1


def test_a_forked_child_opens_a_link_of_its_own() -> None:
    def echo(server: RawLinks, conn: socket.socket, got: list) -> bool:
        conn.sendall(b"".join(answer(s, meta) for _, s, meta in got))
        return True

    server = RawLinks(echo)
    mux = LinkMux()
    assert start(mux, server.url, "parent").result(timeout=30)[4] == [(RESULT, b"parent")]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's link and reader are not its own
        try:
            seen = start(mux, server.url, "child").result(timeout=30)[4]
            os.write(write, b"ok" if seen == [(RESULT, b"child")] else repr(seen).encode())
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 4096)
    os.close(read)
    os.waitpid(pid, 0)
    assert got == b"ok"
    assert start(mux, server.url, "parent again").result(timeout=30)[3] is None
    assert server.links == 2  # the parent's link lives on; the child opened its own


def test_a_future_ended_by_the_reader_is_ended_after_the_calls_its_turn_started_left(
    monkeypatch,
) -> None:
    """What ends a call on the reader's thread (``readerthread.after_turn``) runs once the
    turn's writes are made: the waiter wakes while the reader waits, not while it sends."""
    from ktlite.net import podlinks, readerthread

    order: list[str] = []
    write = podlinks._Link.write

    def spy(self: Any, data: bytes, timeout: float = 30.0) -> None:
        order.append("write")
        write(self, data, timeout)

    monkeypatch.setattr(podlinks._Link, "write", spy)

    def echo(server: RawLinks, conn: socket.socket, got: list) -> bool:
        conn.sendall(b"".join(answer(s, meta) for _, s, meta in got))
        return True

    server = RawLinks(echo)
    mux = LinkMux()
    ended: concurrent.futures.Future = concurrent.futures.Future()

    def second(status: int, headers: dict, body: Any, error: BaseException | None) -> None:
        ended.set_result(error)

    def first(status: int, headers: dict, body: Any, error: BaseException | None) -> None:
        # as Submissions does: the next call starts (on the reader: it joins the turn's
        # write), then the ended call's future is ended after the turn
        mux.start(server.url, HEADERS, "second", [b"a"], None, 30.0, lambda k, p: None, second)
        order.append("started")
        readerthread.after_turn(order.append, "ended")

    mux.start(server.url, HEADERS, "first", [b"a"], None, 30.0, lambda k, p: None, first)
    assert ended.result(timeout=30) is None
    assert order == ["write", "started", "write", "ended"], order
    calls: list[str] = []
    readerthread.after_turn(calls.append, "now")  # not a reader's thread: at once
    assert calls == ["now"]
