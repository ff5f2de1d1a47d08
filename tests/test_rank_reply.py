"""A rank's reply: the inline result built in one step is the bytes ``rankchannel.encode``
makes, a plain value's message is ``codec.dumps_plain``'s, output still held in a stream is
flushed before the reply (real child processes writing to a real pipe), and the channel's
reads without a bell (a real socketpair)."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from ktlite_server import rankreply
from ktlite_wire import codec, envelope, rankchannel
from ktlite_wire.errors import ProtocolError
from ktlite_wire.rankend import Channel

PLAIN = [None, True, False, 0, -7, 1 << 70, 2.5, "", "text é", b"", b"\x00bytes"]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_value_is_dumps_plain(value: object) -> None:
    assert rankreply.is_plain(value)
    assert rankreply.plain_value(value) == envelope.join(codec.dumps_plain(value))
    assert codec.loads(bytearray(rankreply.plain_value(value))) == value
    assert rankreply.encoded(value) == [rankreply.plain_value(value)]


def test_none_value_and_what_is_not_plain() -> None:
    assert envelope.join(codec.dumps_plain(None)) == rankreply.NONE_VALUE
    for value in ("x" * rankreply.PLAIN_MAX, [1], {"a": 1}, (1,), 1j):
        assert not rankreply.is_plain(value)
        assert codec.loads(bytearray(envelope.join(rankreply.encoded(value)))) == value


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=4)))
def test_result_frame_is_the_encoded_result(flags: tuple[bool, bool, bool, bool]) -> None:
    ok, has_pg, tainted, released = flags
    for call_id, inline in (("c1", rankreply.NONE_VALUE), ("é" * 40, b"x" * 5000)):
        frame = rankchannel.result_frame(call_id, ok, inline, has_pg, tainted, released)
        msg = rankchannel.Result(
            call_id, ok, inline, None, len(inline), has_pg, tainted, False, released
        )
        assert frame == envelope.join(rankchannel.encode(msg))
        back = rankchannel.decode(bytearray(frame[rankchannel.LEN.size :]))
        assert isinstance(back, rankchannel.Result)
        assert (back.id, back.ok, bytes(back.inline or b""), back.size) == (
            call_id,
            ok,
            inline,
            len(inline),
        )
        assert (back.has_pg, back.tainted, back.released, back.streaming) == (
            has_pg,
            tainted,
            released,
            False,
        )


def test_result_frame_refuses_a_long_call_id() -> None:
    with pytest.raises(ProtocolError):
        rankchannel.result_frame("x" * 256, True, b"")


# what a child writes before its reply: "a" through sys.stdout, then the marker straight to
# fd 1 after rankreply.flush(); the line must come first, and not be lost at os._exit
_CHILD = """
import io, os, sys
from ktlite_server import rankreply
rankreply.note_streams()
{setup}
print("a")
rankreply.flush()
os.write(1, b"MARK\\n")
os._exit(0)
"""

SETUPS = {
    "started": "",
    "reconfigured": "sys.stdout.reconfigure(write_through=False)",
    "replaced": "sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, 'w', closefd=False)))",
    "replaced_back": "s = sys.stdout; sys.stdout = io.StringIO(); sys.stdout = s",
    "closed_stderr": "sys.stderr.close()",
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_output_is_out_before_the_reply(setup: str) -> None:
    code = textwrap.dedent(_CHILD.format(setup=SETUPS[setup]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=60, check=True
    ).stdout
    assert out == b"a\nMARK\n"


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Channel]]:
    """The pod server's end and the rank's channel (no bell) of a real socketpair."""
    ours, theirs = socket.socketpair()
    ours.settimeout(60)
    yield ours, Channel(theirs)
    ours.close()
    theirs.close()


def _frame(call_id: str) -> bytes:
    payload = codec.dumps((None, (), {}))
    return envelope.join(rankchannel.frame(rankchannel.Call(call_id, payload, None, len(payload))))


def test_channel_reads_whole_coalesced_and_split_messages(
    pair: tuple[socket.socket, Channel],
) -> None:
    ours, chan = pair
    a, b, c = _frame("a"), _frame("b"), _frame("c")
    ours.sendall(a)  # one read, one whole message
    msg = chan.recv()
    assert isinstance(msg, rankchannel.Call) and msg.id == "a"
    assert codec.loads(msg.args) == (None, (), {})
    ours.sendall(b + c[:5])  # two in one read, the second begun
    first = chan.recv()
    assert isinstance(first, rankchannel.Call) and first.id == "b"
    ours.sendall(c[5:])
    second = chan.recv()
    assert isinstance(second, rankchannel.Call) and second.id == "c"
    # each message's arguments are a writable buffer of its own
    assert isinstance(second.args, memoryview) and not second.args.readonly
    assert chan.recv(0.01) is None  # nothing came
    ours.close()
    with pytest.raises(EOFError):
        chan.recv()


def test_channel_waiting_reader_wakes_for_bytes_only(pair: tuple[socket.socket, Channel]) -> None:
    """The pod server reading what the rank sent does not end the rank's wait: only its next
    message (or the channel's end) does."""
    ours, chan = pair
    got: list[object] = []
    sent = threading.Event()

    def rank_side() -> None:
        chan.send_frame(rankchannel.result_frame("r", True, rankreply.NONE_VALUE))
        sent.set()
        got.append(chan.recv())

    t = threading.Thread(target=rank_side, daemon=True)
    t.start()
    assert sent.wait(60)
    reply = ours.recv(65536)  # the server reads the result while the rank waits
    assert rankchannel.decode(bytearray(reply[rankchannel.LEN.size :])).id == "r"  # type: ignore[union-attr]
    assert not got
    ours.sendall(_frame("next"))
    t.join(60)
    assert len(got) == 1 and isinstance(got[0], rankchannel.Call) and got[0].id == "next"
