"""One call sent to several of a pod's ranks at once, and their replies as they arrive.

Every rank's message is written in one pass (a message shared by the ranks is encoded once),
then one ring of the pod's doorbell wakes them all (``doorbell``), and each reply is a future
resolved in the callback that read it (``rankconn``). With a task per rank (its own encode, write, drain
and wait), a 64-rank call took the pod server ~7 ms to write its 64 messages on 2 cores:
each write woke a rank that preempted the server before its next write (``bench/README.md``,
64 ranks on one pod).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from ktlite_server.ranks import RankProcess
from ktlite_wire import rankchannel

Sent = tuple[RankProcess, rankchannel.Call, "asyncio.Future[Any]"]


class Arrivals:
    """Call ``call_id`` sent to each rank of ``sends`` (a rank and its own message); its
    replies (or deaths) come from :meth:`next` in the order they arrive."""

    def __init__(self, call_id: str, sends: list[tuple[RankProcess, rankchannel.Call]]) -> None:
        self.call_id = call_id
        self.left = len(sends)
        self._arrived: list[Sent] = []
        self._wake: asyncio.Future[None] | None = None
        self._sent: list[Sent] = []
        frames: dict[int, list[Any]] = {}  # id(message) -> it encoded
        now = time.monotonic()
        bells: dict[int, tuple[Any, int]] = {}  # each doorbell, rung once: the ranks it wakes
        for rank, msg in sends:
            frame = frames.get(id(msg))
            if frame is None:
                frame = frames[id(msg)] = rankchannel.frame(msg)
            rank.running[call_id] = now
            future = rank.post(msg, frame, ring=False)
            bell = rank.bell
            if bell is not None:
                _, mask = bells.get(id(bell), (bell, 0))
                bells[id(bell)] = (bell, mask | rank.bit)
            sent = (rank, msg, future)
            self._sent.append(sent)
            future.add_done_callback(functools.partial(self._on_reply, sent))
        for bell, mask in bells.values():
            bell.ring(mask)

    def _on_reply(self, sent: Sent, _: asyncio.Future[Any]) -> None:
        sent[0].running.pop(self.call_id, None)  # even if nobody gathers them any more
        self._arrived.append(sent)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def next(self) -> list[Sent]:
        """The replies that arrived since the last call (at least one; none once all have)."""
        if not self.left:
            return []
        if not self._arrived:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        batch, self._arrived = self._arrived, []
        self.left -= len(batch)
        return batch

    def waiting(self) -> list[RankProcess]:
        """The ranks whose reply has not come yet."""
        return [rank for rank, _, future in self._sent if not future.done()]
