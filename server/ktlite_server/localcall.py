"""One call on this pod's own rank processes, once admitted: the message each rank gets,
their outcomes, and the first failure stopping the others (their processes and state stay;
one that ignores its interrupt for INTERRUPT_GRACE_S is killed)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from ktlite_server import resultmaps
from ktlite_server.deployment import Deployment
from ktlite_server.rankgather import Arrivals
from ktlite_server.ranks import Outcome, RankGone, RankProcess
from ktlite_wire import rankchannel, rankdata, shm
from ktlite_wire.status import Status

logger = logging.getLogger(__name__)

INTERRUPT_GRACE_S = 1.0  # a call stopped on its own has this long to end before its rank is killed
# debugging aid (and the per-rank tests): the pod's log says what each call brought
LOG_BODIES = os.environ.get("KTLITE_LOG_CALL_BODIES", "") not in ("", "0")


class CallHandle:
    """One call while it runs on this pod: how it was stopped (if it was), when it started,
    its outcomes once it ended."""

    __slots__ = ("call_id", "stop_kind", "stop_reason", "started", "outcomes", "_done")

    def __init__(self, call_id: str) -> None:
        self.call_id = call_id
        self.stop_kind: Status | None = None
        self.stop_reason = ""
        self.started = time.monotonic()
        self.outcomes: list[Outcome] = []
        self._done: asyncio.Event | None = None  # made only when a duplicate delivery waits

    async def wait(self) -> None:
        """Return once the call ended (a duplicate delivery waits for the first)."""
        if self._done is None:
            self._done = asyncio.Event()
        await self._done.wait()

    def ended(self) -> None:
        if self._done is not None:
            self._done.set()


class LocalCall:
    def __init__(self, handle: CallHandle, dep: Deployment, ranks: list[RankProcess]) -> None:
        self.handle = handle
        self.dep = dep
        self.ranks = ranks

    def prepare(
        self,
        payload: Any,
        path: str | None,
        per_rank: dict[str, Any] | None,
        generation: int,
        group_port: int | None,
    ) -> tuple[rankchannel.Call, dict[int, bytes] | None, dict[int, list[int]] | None, str | None]:
        """The call's message to the ranks, each rank's own items (inline, or where they are in
        the shared-memory file), and the shared-memory file made here for a large payload
        (the caller removes it once the call ends)."""
        dep = self.dep
        view = memoryview(payload).cast("B")
        items: dict[int, bytes] | None = None  # small per-rank items, sent inline
        item_at: dict[int, list[int]] | None = None  # or where they are in the shared-memory file
        own_file = path is None and view.nbytes > shm.INLINE_MAX
        if own_file:  # large: the ranks map it (a per-rank body whole: each maps its own slices)
            path, _ = shm.write([view], shm.ARG_PREFIX)
        if per_rank is not None:  # each rank gets the shared message and its own items
            first = dep.config.first_rank(dep.ordinal)
            slices = rankdata.pod_slices(per_rank, range(first, first + len(self.ranks)))
            if path is not None:
                item_at = {i: [off, n] for i, (off, n) in enumerate(slices)}
            else:
                items = {i: bytes(view[off : off + n]) for i, (off, n) in enumerate(slices)}
            view = view[: per_rank["shared"]]
            if LOG_BODIES:
                logger.info(
                    "call %s: shared message %d bytes; per-rank items %s",
                    self.handle.call_id,
                    view.nbytes,
                    ", ".join(f"rank {first + i}: {n} bytes" for i, (_, n) in enumerate(slices)),
                )
        elif LOG_BODIES:
            logger.info("call %s: message %d bytes", self.handle.call_id, view.nbytes)
        size = view.nbytes
        msg = rankchannel.Call(
            id=self.handle.call_id,
            args=None if path else view,
            path=path,
            size=size,
            generation=generation,
            group_port=group_port,
        )
        return msg, items, item_at, path if own_file else None

    async def fan_in(
        self,
        msg: rankchannel.Call,
        items: dict[int, bytes] | None,
        item_at: dict[int, list[int]] | None,
        only: set[int] | None = None,
    ) -> list[Outcome]:
        handle = self.handle
        now = time.monotonic()
        calls = []
        for r in self.ranks:
            if only is not None and r.global_rank not in only:
                continue  # the call names other ranks
            r.busy_since = r.busy_since or now
            own = (
                msg
                if items is None and item_at is None
                else dataclasses.replace(
                    msg,
                    item=None if items is None else items[r.local_rank],
                    item_at=None if item_at is None else item_at[r.local_rank],
                )
            )
            calls.append((r, own))
        if len(calls) == 1:  # one rank: no other to stop when it fails, no task to wait on
            r, own = calls[0]
            return [self._alone(r, await self._call_rank(r, own))]
        # every rank's message written in one pass, each reply taken as it arrives
        arrivals = Arrivals(handle.call_id, calls)
        outcomes: dict[int, Outcome] = {}
        while arrivals.left:
            for reply in await arrivals.next():  # each rank's output read already
                r, own = reply.rank, reply.msg
                try:
                    if reply.error is not None:
                        raise reply.error
                    o = self._outcome(r, own, r.check(own.id, reply.value))
                except RankGone as e:  # its death, or a reply out of step
                    o = self._gone(r, own, e)
                outcomes[o.rank] = o  # (its rank's running and busy_since: see Arrivals)
                if o.status is not Status.OK and not handle.stop_kind:
                    handle.stop_kind = Status.CANCELLED
                    handle.stop_reason = f"stopped because rank {o.rank} failed"
                    for other in arrivals.waiting():
                        stop_rank(other, handle.call_id, concurrent=self.dep.concurrency > 1)
        return [outcomes[k] for k in sorted(outcomes)]

    def start_one(
        self, rank: RankProcess, msg: rankchannel.Call, then: Callable[[Outcome], None]
    ) -> None:
        """Send ``msg`` to ``rank``, the call's one rank, without a task: ``then`` gets its
        outcome in the callback that read its reply (or saw its death): ``PodCalls.run_now``."""
        rank.busy_since = rank.busy_since or time.monotonic()
        rank.running[self.handle.call_id] = time.monotonic()
        resultmaps.server().release()  # result files nothing sends from: the rank may reuse
        rank.send(msg, _OneReply(self, rank, msg, then))

    def _alone(self, rank: RankProcess, o: Outcome) -> Outcome:
        """The outcome of the call's one rank, the rank's part of the call over: its failure
        stops the call (no other rank to stop)."""
        if not rank.running:
            rank.busy_since = None
        handle = self.handle
        if o.status is not Status.OK and not handle.stop_kind:
            handle.stop_kind = Status.CANCELLED
            handle.stop_reason = f"stopped because rank {o.rank} failed"
        return o

    async def _call_rank(self, rank: RankProcess, msg: rankchannel.Call) -> Outcome:
        handle = self.handle
        rank.running[handle.call_id] = time.monotonic()
        try:
            result = await rank.call(msg)
        except RankGone as e:
            return self._gone(rank, msg, e)
        finally:
            rank.running.pop(handle.call_id, None)
        return self._outcome(rank, msg, result)

    def _gone(self, rank: RankProcess, msg: rankchannel.Call, e: RankGone) -> Outcome:
        # we stopped it (SIGKILL); a rank that exited by itself, even while we were
        # stopping it, keeps its own exit code and is reported as a death. A rank that
        # ran other calls too fails each of them with its death. (A process it forked
        # may still map the argument file: it counts as held.)
        handle = self.handle
        held = msg.path is not None
        if handle.stop_kind and rank.stopping and rank.exit_code in (None, -signal.SIGKILL):
            return Outcome(
                rank.global_rank,
                handle.stop_kind,
                message=handle.stop_reason,
                holds_args=held,
            )
        rank.died_in_call = True
        return Outcome(rank.global_rank, Status.DIED, message=str(e), holds_args=held)

    def _outcome(
        self, rank: RankProcess, msg: rankchannel.Call, result: rankchannel.Result
    ) -> Outcome:
        handle = self.handle
        if rank.tainted:  # stopped inside an import: replaced before its next call
            rank.kill()
        held = msg.path is not None and not result.released
        if (
            not result.ok and handle.stop_kind
        ):  # interrupted on its own (CallInterrupted): the stop's outcome
            if result.path is not None:  # its exception's info, large: nobody takes the file
                rank.feed(handle.call_id)
                shm.remove_later(result.path)
            return Outcome(
                rank.global_rank, handle.stop_kind, message=handle.stop_reason, holds_args=held
            )
        return Outcome(  # by position (one per rank per call: keywords cost a dict)
            rank.global_rank,
            Status.OK if result.ok else Status.ERROR,
            result.inline,
            "",  # message
            result.path,
            result.size,
            rank.feed(handle.call_id) if result.streaming else None,  # feed
            held,  # holds_args
        )


class _OneReply:
    """The reply of a call's one rank (a :class:`~ktlite_server.ranks.Waiter`), started by
    :meth:`LocalCall.start_one`: made into its outcome as :meth:`LocalCall._call_rank` makes
    it, in the callback that read it."""

    __slots__ = ("call", "rank", "msg", "then", "_done")

    def __init__(
        self,
        call: LocalCall,
        rank: RankProcess,
        msg: rankchannel.Call,
        then: Callable[[Outcome], None],
    ) -> None:
        self.call = call
        self.rank = rank
        self.msg = msg
        self.then = then
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, reply: Any, /) -> None:
        if self._done:
            return
        self._done = True
        call, rank = self.call, self.rank
        try:
            o = call._outcome(rank, self.msg, rank.answer(self.msg.id, reply))
        except RankGone as e:  # a reply out of step
            o = call._gone(rank, self.msg, e)
        except Exception as e:  # noqa: BLE001 - never out of the channel's read callback
            logger.exception("call %s: the reply of rank %d", self.msg.id, rank.global_rank)
            o = Outcome(rank.global_rank, Status.DIED, message=f"{type(e).__name__}: {e}")
        finally:
            rank.running.pop(self.msg.id, None)
        self.then(call._alone(rank, o))

    def set_exception(self, exception: BaseException, /) -> None:
        if self._done:
            return
        self._done = True
        call, rank = self.call, self.rank
        rank.running.pop(self.msg.id, None)
        gone = exception if isinstance(exception, RankGone) else RankGone(str(exception))
        self.then(call._alone(rank, call._gone(rank, self.msg, gone)))


def stop_rank(rank: RankProcess, call_id: str, concurrent: bool) -> None:
    """Stop one call on one rank and keep the process (and its state): the call is
    interrupted (CallInterrupted raised in it: SIGUSR2 on the main thread, an async
    exception on a pool thread, a cancelled coroutine), and only if it has not ended
    within INTERRUPT_GRACE_S (blocked in C code, in a collective) the rank is killed."""

    async def interrupt() -> None:
        if concurrent:
            await rank.interrupt(call_id)
        else:
            rank.interrupt_main()
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while call_id in rank.running and rank.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if call_id in rank.running and rank.alive:
            logger.warning(
                "call %s ignored its interrupt for %gs: killing rank %d and the calls it ran",
                call_id,
                INTERRUPT_GRACE_S,
                rank.global_rank,
            )
            rank.kill()

    asyncio.get_running_loop().create_task(interrupt())
