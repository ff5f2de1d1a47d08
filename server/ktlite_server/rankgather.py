"""One call sent to several of a pod's ranks at once, and their replies as they arrive.

Every rank's message is written in one pass (a message shared by the ranks is encoded once),
then one ring of the pod's doorbell wakes them all (``doorbell``). With a task per rank (its
own encode, write, drain and wait), a 64-rank call took the pod server ~7 ms to write its 64
messages on 2 cores: each write woke a rank that preempted the server before its next write
(``bench/README.md``, 64 ranks on one pod).

Each reply resolves its rank's :class:`Reply` in the protocol callback that read it
(``rankconn``): not a future with two done callbacks (each a handle the loop schedules and
runs, 64 of them a call). The task gathering them is woken once: by the last reply, or at
once by a failure (issue 26, item 4: the pod server's CPU per rank).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ktlite_server import resultmaps
from ktlite_server.rankoutput import pipes
from ktlite_server.ranks import RankProcess
from ktlite_wire import rankchannel


class Reply:
    """One rank's reply to a gathered call (a :class:`~ktlite_server.ranks.Waiter`): resolved
    in the callback that read it (or by the rank's death), which hands it to its
    :class:`Arrivals` at once."""

    __slots__ = ("rank", "msg", "value", "error", "_gather")

    def __init__(self, rank: RankProcess, msg: rankchannel.Call, gather: Arrivals) -> None:
        self.rank = rank
        self.msg = msg
        self.value: Any = None  # the rank's reply (never None once it came)
        self.error: BaseException | None = None  # or its death (RankGone)
        self._gather = gather

    def done(self) -> bool:
        return self.value is not None or self.error is not None

    def set_result(self, value: Any, /) -> None:
        if self.value is None and self.error is None:  # (done(), inline: once per rank)
            self.value = value
            # a reply that is a value wakes the gatherer only if it is the last one due
            self._gather._arrive(self, type(value) is rankchannel.Result and value.ok)

    def set_exception(self, exception: BaseException, /) -> None:
        if self.value is None and self.error is None:
            self.error = exception
            self._gather._arrive(self)

    def result(self) -> Any:
        """The rank's reply; raises its death (RankGone)."""
        if self.error is not None:
            raise self.error
        return self.value

    def exception(self) -> BaseException | None:
        return self.error


class Arrivals:
    """Call ``call_id`` sent to each rank of ``sends`` (a rank and its own message); its
    replies (or deaths) come from :meth:`next` in the order they arrive, each batch once every
    rank's output so far is read (a rank's log lines precede its result: ``rankoutput``). A
    rank's part of the call ends with its reply (``running``; ``busy_since`` once it runs no
    other call)."""

    def __init__(self, call_id: str, sends: list[tuple[RankProcess, rankchannel.Call]]) -> None:
        self.call_id = call_id
        self.left = len(sends)  # replies not yet taken by next()
        self._due = len(sends)  # replies not yet come
        self._arrived: list[Reply] = []
        self._wake: asyncio.Future[None] | None = None
        self._sent: list[Reply] = []
        now = time.monotonic()
        resultmaps.server().release()  # result files nothing sends from: the ranks may reuse
        last: rankchannel.Call | None = None  # the last message encoded (usually every rank's)
        frame: list[Any] = []
        bells: dict[int, list[Any]] = {}  # each doorbell, rung once: [it, the ranks it wakes]
        ring: list[Any] = [None, 0]
        for rank, msg in sends:
            if msg is not last:
                last, frame = msg, rankchannel.frame(msg)
            rank.running[call_id] = now
            reply = Reply(rank, msg, self)
            self._sent.append(reply)
            rank.send(msg, reply, frame, ring=False)
            bell = rank.bell
            if bell is not None:
                if bell is not ring[0]:
                    ring = bells.setdefault(id(bell), [bell, 0])
                ring[1] |= rank.bit
        for bell, mask in bells.values():
            bell.ring(mask)

    def _arrive(self, reply: Reply, quiet: bool = False) -> None:
        """``reply`` came (or its rank died); ``quiet``: a value, which wakes the gatherer only
        if no other reply is due (a failure wakes it at once: the caller stops the others)."""
        rank = reply.rank
        rank.running.pop(self.call_id, None)  # even if nobody gathers them any more
        if not rank.running:
            rank.busy_since = None
        self._arrived.append(reply)
        self._due -= 1
        if quiet and self._due:
            return
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def next(self) -> list[Reply]:
        """The replies that arrived since the last call (at least one; none once all have),
        once the ranks' pipes are drained (one poll for the batch). It waits for every reply
        due, or for one that is not a value (a failure, a death: the caller stops the others at
        once): replies that are values wake nobody but the last (the task's wake-up, the
        coroutines it resumes and the poll, once a call, not once per batch the loop read)."""
        if not self.left:
            return []
        if not self._arrived:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        batch, self._arrived = self._arrived, []
        self.left -= len(batch)
        pipes().drain()
        return batch

    def waiting(self) -> list[RankProcess]:
        """The ranks whose reply has not come yet."""
        return [reply.rank for reply in self._sent if not reply.done()]
