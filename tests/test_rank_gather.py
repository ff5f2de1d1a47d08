"""A call gathered from several ranks (``ktlite_server.rankgather``): each reply resolves its
rank's Reply in the callback that read it, and the gathering task is woken once, by the last
reply, unless one fails (a failed or out-of-step reply, a death): that one wakes it at once,
so the other ranks are stopped without waiting for them. Stand-in ranks: the replies are
handed in by the test, in the order it chooses (real processes: test_rank_doorbell.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from ktlite_server.rankgather import Arrivals, Reply
from ktlite_server.ranks import RankGone
from ktlite_wire import codec, rankchannel


class _Rank:
    """What Arrivals uses of a RankProcess: ``send`` keeps the Reply for the test to resolve."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = self.global_rank = local_rank
        self.running: dict[str, float] = {}
        self.busy_since: float | None = 1.0
        self.bell = None
        self.bit = 1 << local_rank
        self.reply: Reply | None = None
        self.frames: list[list[Any]] = []

    def send(self, msg: rankchannel.Call, reply: Reply, frame: list[Any], ring: bool) -> None:
        assert not ring, "the gather rings once for every rank"
        self.frames.append(frame)
        self.reply = reply


def _ok(call_id: str) -> rankchannel.Result:
    value = codec.dumps(None)
    return rankchannel.Result(call_id, True, value, None, len(value))


async def _pending(arrivals: Arrivals) -> asyncio.Task[list[Reply]]:
    """``arrivals.next()`` as a task, run until it waits."""
    task = asyncio.get_running_loop().create_task(arrivals.next())
    for _ in range(5):
        await asyncio.sleep(0)
    return task


def _gather(n: int) -> tuple[list[_Rank], Arrivals, rankchannel.Call]:
    ranks = [_Rank(i) for i in range(n)]
    args = codec.dumps((None, (), {}))
    msg = rankchannel.Call("g1", args, size=len(args))
    return ranks, Arrivals("g1", [(r, msg) for r in ranks]), msg  # type: ignore[misc]


def test_values_wake_the_gatherer_once_with_the_last_each_rank_idle_from_its_own() -> None:
    async def main() -> None:
        ranks, arrivals, _ = _gather(4)
        assert all(r.running == {"g1": r.running["g1"]} for r in ranks)
        assert ranks[0].frames[0] is ranks[3].frames[0], "one message encoded once for all"
        task = await _pending(arrivals)
        for r in (ranks[2], ranks[0], ranks[3]):
            assert r.reply is not None
            r.reply.set_result(_ok("g1"))
            assert r.running == {} and r.busy_since is None  # idle from its own reply
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done(), "a value that is not the last due woke the gatherer"
        assert ranks[1].busy_since == 1.0
        assert ranks[1].reply is not None
        ranks[1].reply.set_result(_ok("g1"))
        batch = await asyncio.wait_for(task, 10)
        assert [reply.rank.local_rank for reply in batch] == [2, 0, 3, 1]
        assert arrivals.left == 0 and await arrivals.next() == []

    asyncio.run(main())


def test_a_failure_a_death_or_a_reply_out_of_step_wakes_the_gatherer_at_once() -> None:
    async def main() -> None:
        ranks, arrivals, _ = _gather(4)
        replies = [r.reply for r in ranks if r.reply is not None]
        assert len(replies) == 4
        task = await _pending(arrivals)
        replies[0].set_result(_ok("g1"))
        replies[1].set_result(rankchannel.Result("g1", False, b"info", None, 4))
        batch = await asyncio.wait_for(task, 10)
        assert [reply.rank.local_rank for reply in batch] == [0, 1]
        assert [r.local_rank for r in arrivals.waiting()] == [2, 3]  # the ones to stop

        task = await _pending(arrivals)
        replies[2].set_exception(RankGone("rank process was killed by SIGKILL"))
        (dead,) = await asyncio.wait_for(task, 10)
        assert isinstance(dead.exception(), RankGone) and ranks[2].running == {}

        task = await _pending(arrivals)
        replies[3].set_result(rankchannel.Loaded(True))
        (odd,) = await asyncio.wait_for(task, 10)
        assert isinstance(odd.value, rankchannel.Loaded)
        replies[3].set_result(_ok("g1"))  # a second one: ignored
        assert odd.done() and isinstance(odd.value, rankchannel.Loaded)
        assert arrivals.left == 0

    asyncio.run(main())
