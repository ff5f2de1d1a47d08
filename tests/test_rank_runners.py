"""A rank's concurrent calls (``Compute(concurrency=K)``): quick ones run one after another on
one thread, one stuck behind a long call gets a thread of its own, a queued one is taken back
by its interrupt (``ktlite_server.rankrunners``). A real ``Rank`` over a real socketpair, its
calls on real threads; the reading loop is the rank process's own (``chan.recv(patience)``)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import cloudpickle
import pytest

from ktlite_server import rankrunners
from ktlite_server.rank import Rank
from ktlite_wire import codec, rankchannel
from ktlite_wire.rankend import Channel

LONG = 60.0  # what a wait that should end at once is bounded by


def ident() -> int:
    return threading.get_ident()


GATE: dict[str, threading.Event] = {}


def wait_for(name: str) -> int:
    """Block until ``open_gate(name)`` ran (in another call on this rank)."""
    if not GATE[name].wait(LONG):
        raise TimeoutError(f"nobody opened {name!r} within {LONG:g} s")
    return threading.get_ident()


def open_gate(name: str) -> int:
    GATE[name].set()
    return threading.get_ident()


class Server:
    """The pod server's end of one in-process rank: sends messages, reads replies."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(LONG)
        self.buf = bytearray()

    def send(self, msg: rankchannel.Message) -> None:
        self.sock.sendall(b"".join(rankchannel.frame(msg)))

    def call(self, call_id: str, fn: str, *args: object) -> None:
        payload = codec.dumps((None, (fn, *args), {}))
        self.send(rankchannel.Call(id=call_id, args=payload, size=len(payload)))

    def reply(self) -> rankchannel.Message:
        while True:
            if len(self.buf) >= 8:
                (n,) = rankchannel.LEN.unpack_from(self.buf)
                if len(self.buf) >= 8 + n:
                    body = bytes(self.buf[8 : 8 + n])
                    del self.buf[: 8 + n]
                    return rankchannel.decode(body)
            data = self.sock.recv(65536)
            assert data, "the rank closed its channel"
            self.buf += data

    def results(self, n: int) -> dict[str, tuple[bool, object]]:
        out = {}
        for _ in range(n):
            msg = self.reply()
            assert isinstance(msg, rankchannel.Result), msg
            out[msg.id] = (msg.ok, codec.loads(bytearray(msg.inline or b"")))
        return out


def _dispatch(name: str, *args: object) -> object:
    return {"ident": ident, "wait_for": wait_for, "open_gate": open_gate}[name](*args)


@pytest.fixture
def rank() -> Iterator[Server]:
    """A Rank with concurrency 4 loaded with ``_dispatch``, its reading loop on a thread."""
    ours, theirs = socket.socketpair()
    chan = Channel(theirs)
    r = Rank(chan)

    def read() -> None:
        while True:
            try:
                msg = chan.recv(r.patience())
            except (EOFError, OSError):
                return
            if isinstance(msg, rankchannel.Load):
                r.load(msg)
            elif isinstance(msg, rankchannel.Call):
                r.submit(msg)
            elif isinstance(msg, rankchannel.Interrupt):
                r.interrupt(msg.id)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    server = Server(ours)
    server.send(rankchannel.Load(env={}, bundle=cloudpickle.dumps(_dispatch), concurrency=4))
    loaded = server.reply()
    assert isinstance(loaded, rankchannel.Loaded) and loaded.ok
    yield server
    ours.close()
    reader.join(LONG)
    if r.runners is not None:
        r.runners.close()
    theirs.close()


def test_quick_calls_arriving_together_run_on_one_thread(rank: Server, monkeypatch) -> None:
    # no call here is slow on any machine, however loaded, by these bounds
    monkeypatch.setattr(rankrunners, "SHORT_S", LONG)
    monkeypatch.setattr(rankrunners, "STUCK_S", LONG)
    rank.call("warm", "ident")
    rank.results(1)
    for i in range(6):
        rank.call(f"c{i}", "ident")
    results = rank.results(6)
    assert all(ok for ok, _ in results.values()), results
    threads = {value for _, value in results.values()}
    assert len(threads) == 1, f"6 quick calls ran on {len(threads)} threads, not one after another"


def test_a_call_queued_behind_a_blocked_one_gets_a_thread_of_its_own(rank: Server) -> None:
    """The blocked call waits for the queued one: only a second thread lets both end."""
    GATE["g1"] = threading.Event()
    rank.call("blocked", "wait_for", "g1")
    rank.call("opener", "open_gate", "g1")
    results = rank.results(2)
    assert results["blocked"][0] and results["opener"][0], results
    assert results["blocked"][1] != results["opener"][1]


def test_a_queued_call_is_taken_back_by_its_interrupt(rank: Server, monkeypatch) -> None:
    monkeypatch.setattr(rankrunners, "SHORT_S", LONG)
    monkeypatch.setattr(rankrunners, "STUCK_S", LONG)  # the queued call stays queued
    GATE["g2"] = threading.Event()
    rank.call("warm", "ident")
    rank.results(1)
    rank.call("blocked", "wait_for", "g2")
    rank.call("queued", "ident")
    rank.send(rankchannel.Interrupt("queued"))
    msg = rank.reply()  # the interrupted call answers while the other still runs
    assert isinstance(msg, rankchannel.Result) and msg.id == "queued" and not msg.ok, msg
    info = codec.loads(bytearray(msg.inline or b""))
    assert "stopped before it started" in info.message, info
    GATE["g2"].set()
    assert rank.results(1)["blocked"][0]


@pytest.mark.parametrize("with_bell", [False, True])
def test_a_channel_read_with_a_timeout_returns_none_when_nothing_came(with_bell: bool) -> None:
    from ktlite_server import doorbell

    bell = doorbell.create() if with_bell else None
    if with_bell and bell is None:
        pytest.skip("no futex doorbell here")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        chan = Channel(theirs, bell, 1)
        assert chan.recv(0.01) is None
        assert chan.recv(0.0) is None
        ours.sendall(b"".join(rankchannel.frame(rankchannel.Interrupt("x"))))
        if bell is not None:
            bell.ring(1)
        got = chan.recv(LONG)
        assert isinstance(got, rankchannel.Interrupt) and got.id == "x"
