"""A call to a pod's ranks: every rank's message written, then one wake-up for them all
(issue 26, item 4: 64 ranks on one pod).

The pod server writes each rank's message to its channel without waking it, and rings the
pod's doorbell (``ktlite_server.doorbell``: a futex word the ranks wait on) once; its replies
are read by a protocol callback (``ktlite_server.rankconn``), not a task per rank. Real rank
processes and sockets throughout.
"""

from __future__ import annotations

import asyncio
import functools
import operator
import os
import socket
import sys
import threading
import time

import cloudpickle
import pytest

from ktlite_server import doorbell
from ktlite_server.pod import Pod
from ktlite_server.rankconn import RankConnection
from ktlite_server.rankgather import Arrivals
from ktlite_server.ranks import RankProcess
from ktlite_wire import codec, rankchannel, rankend
from ktlite_wire.errors import ProtocolError

pytestmark = pytest.mark.skipif(
    doorbell.create() is None, reason="the doorbell needs Linux futexes (x86_64 or aarch64)"
)
LONG = 60.0  # a wait the ring must end long before (a missed ring would take this long)


def _waiter(bell: doorbell.Doorbell, bit: int) -> threading.Thread:
    """A thread blocked in the doorbell's futex wait (seen in /proc, not guessed by a sleep)."""
    generation = bell.generation
    tid: list[int] = []

    def wait() -> None:
        tid.append(threading.get_native_id())
        bell.wait(generation, bit, LONG)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    deadline = time.monotonic() + LONG
    while time.monotonic() < deadline:
        if tid and _blocked_on(tid[0], bell.address):
            return thread
        os.sched_yield()
    raise AssertionError("the waiting thread never reached its futex wait")


def _blocked_on(tid: int, address: int) -> bool:
    """Whether thread ``tid`` of this process is in a futex call on ``address`` now."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] in ("202", "98") and int(fields[1], 16) == address


@pytest.mark.parametrize("local_rank", [0, 1, 30, 31, 63])
def test_a_ring_wakes_a_rank_of_any_local_rank(local_rank: int) -> None:
    """Bit 31 is a rank's too (ranks 31 and 63 of 64): a ring with it wakes them."""
    bell = doorbell.create()
    assert bell is not None
    bit = doorbell.Doorbell.bit(local_rank)
    thread = _waiter(bell, bit)
    bell.ring(bit | doorbell.Doorbell.bit(local_rank + 1))
    thread.join(LONG / 4)
    assert not thread.is_alive(), f"rank {local_rank}'s wait (bit {bit:#x}) missed its ring"


def _call(i: int) -> rankchannel.Call:
    args = codec.dumps((None, (i,), {}))
    return rankchannel.Call(id=f"call-{i}", args=args, size=len(args))


def test_a_rank_channel_waits_on_the_bell_and_reads_joined_and_split_messages() -> None:
    bell = doorbell.create()
    assert bell is not None
    server, rank = socket.socketpair()
    chan = rankend.Channel(rank, bell, bell.bit(5))
    got: list[rankchannel.Message | BaseException] = []

    def read(n: int) -> None:
        try:
            for _ in range(n):
                got.append(chan.recv())
        except BaseException as e:  # noqa: BLE001 - the test reads it
            got.append(e)

    with server, rank:
        reader = threading.Thread(target=read, args=(3,), daemon=True)
        reader.start()
        # two messages in one write and one ring; the third written in three pieces
        server.sendall(b"".join(rankchannel.frame(_call(1)) + rankchannel.frame(_call(2))))
        bell.ring(bell.bit(5))
        third = b"".join(rankchannel.frame(_call(3)))
        server.sendall(third[:5])
        bell.ring(bell.bit(5))
        server.sendall(third[5:20])
        server.sendall(third[20:])
        reader.join(LONG)
        assert [m.id for m in got if isinstance(m, rankchannel.Call)] == [
            "call-1",
            "call-2",
            "call-3",
        ], got
        assert codec.loads(bytearray(got[2].args or b""))[1] == (3,)  # type: ignore[union-attr]
        # the pod server gone: the rank learns it from its channel, without a ring
        got.clear()
        reader = threading.Thread(target=read, args=(1,), daemon=True)
        reader.start()
        server.shutdown(socket.SHUT_WR)
        reader.join(LONG)
    assert len(got) == 1 and isinstance(got[0], EOFError), got


def test_the_pod_servers_end_reads_joined_split_and_malformed_messages() -> None:
    async def main() -> tuple[list[rankchannel.Message], list[ProtocolError], bool]:
        loop = asyncio.get_running_loop()
        messages: list[rankchannel.Message] = []
        bad: list[ProtocolError] = []
        lost = loop.create_future()
        ours, theirs = socket.socketpair()
        await loop.create_unix_connection(
            lambda: RankConnection(messages.append, bad.append, lambda: lost.set_result(True)),
            sock=ours,
        )
        results = [
            b"".join(rankchannel.encode(rankchannel.Result(f"c{i}", True, b"v" * i, None, i)))
            for i in range(3)
        ]
        with theirs:
            theirs.sendall(results[0] + results[1])
            for k in range(len(results[2])):  # one byte at a time
                theirs.sendall(results[2][k : k + 1])
                await asyncio.sleep(0)  # let the loop read each byte apart
            theirs.sendall(rankchannel.LEN.pack(3) + b"KTX")  # a message of no known type
            closed = await asyncio.wait_for(lost, LONG)
        return messages, bad, closed

    messages, bad, closed = asyncio.run(main())
    assert [
        (m.id, bytes(m.inline or b"")) for m in messages if isinstance(m, rankchannel.Result)
    ] == [
        ("c0", b""),
        ("c1", b"v"),
        ("c2", b"vv"),
    ]
    assert len(bad) == 1 and closed, "a malformed message closes the channel and is reported"


def test_a_call_to_many_ranks_is_written_to_all_then_rung_once() -> None:
    """Four real rank processes: one call, one ring, four replies (and a dead rank's death)."""

    async def main() -> tuple[int, list[int], str]:
        ranks = [RankProcess(i, {}, lambda *_: None) for i in range(4)]
        try:
            await asyncio.gather(*(r.start(LONG) for r in ranks))
            bundle = cloudpickle.dumps(functools.partial(operator.add, 1))
            for r in ranks:
                loaded = await r.load(rankchannel.Load(env={}, bundle=bundle), LONG)
                assert loaded.ok
            bell = ranks[0].bell
            assert bell is not None and all(r.bell is bell for r in ranks)
            before = bell.rings
            arrivals = Arrivals("call-7", [(r, _call(7)) for r in ranks])
            values: list[int] = []
            while arrivals.left:
                for reply in await asyncio.wait_for(arrivals.next(), LONG):
                    result = reply.rank.check(reply.msg.id, reply.result())
                    values.append(codec.loads(bytearray(result.inline or b"")))
            rings = bell.rings - before
            ranks[3].kill()
            await ranks[3].wait_dead(LONG)
            arrivals = Arrivals("call-8", [(ranks[3], _call(8))])
            (done,) = await asyncio.wait_for(arrivals.next(), LONG)
            death = str(done.exception())
            return rings, values, death
        finally:
            for r in ranks:
                r.kill()
            await asyncio.gather(*(r.wait_dead(LONG) for r in ranks))
            await asyncio.sleep(0)  # the transports' close callbacks

    rings, values, death = asyncio.run(main())
    assert rings == 1, f"a call to 4 ranks rang the doorbell {rings} times"
    assert values == [8, 8, 8, 8]
    assert "rank process was killed by SIGKILL" in death


def test_a_rank_started_without_a_doorbell_still_reads_its_channel() -> None:
    """A rank process whose pod server has no doorbell (another OS) blocks on its channel."""
    server, rank = socket.socketpair()
    with server, rank:
        chan = rankend.Channel(rank)
        server.sendall(b"".join(rankchannel.frame(_call(4))))
        msg = chan.recv()
    assert isinstance(msg, rankchannel.Call) and msg.id == "call-4"


@pytest.mark.parametrize("procs", [1, 3])
def test_a_pods_only_rank_waits_on_its_channel_and_several_on_the_bell(procs: int) -> None:
    """One rank gains nothing from the bell (a ring wakes it alone): it blocks on its channel,
    which a write wakes, and a call costs it and the pod server a system call less each."""

    async def main() -> tuple[list[bool], list[int], list[int]]:
        pod = Pod("bell-test", 0, procs)
        await pod.prespawn()
        try:
            # the rank's own argv (a forked rank's /proc cmdline is its zygote's)
            bundle = cloudpickle.dumps(lambda i: (i + 1, len(sys.argv)))
            values, argc = [], []
            for r in pod.ranks:
                assert (await r.load(rankchannel.Load(env={}, bundle=bundle), LONG)).ok
                result = await asyncio.wait_for(r.call(_call(r.local_rank)), LONG)
                value, n = codec.loads(bytearray(result.inline or b""))
                values.append(value)
                argc.append(n)
            return [r.bell is not None for r in pod.ranks], values, argc
        finally:
            for r in pod.ranks:
                r.kill()
            await asyncio.gather(*(r.wait_dead(LONG) for r in pod.ranks))
            await asyncio.sleep(0)

    belled, values, argc = asyncio.run(main())
    assert values == [i + 1 for i in range(procs)]
    assert belled == [procs > 1] * procs, belled
    # the rank's sys.argv: ktlite_server/rank.py FD [BELL_FD BIT]
    assert argc == [2 if procs == 1 else 4] * procs, argc
