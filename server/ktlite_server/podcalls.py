"""The calls one pod runs: admitted in order (up to the deployment's concurrency), each on
all the pod's local ranks at once; a duplicate delivery runs once, a stop that overtakes its
call keeps it from starting. Pod 0 also picks each process-group generation's MASTER_PORT.
Mixed into :class:`~ktlite_server.pod.Pod`, whose rank processes and heals it uses.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ktlite_server.callhistory import CallHistory
from ktlite_server.deployment import Deployment
from ktlite_server.gate import Gate
from ktlite_server.keptoutcomes import Kept, keep, kept
from ktlite_server.localcall import CallHandle, LocalCall, stop_rank
from ktlite_server.metrics import CallMetrics
from ktlite_server.rank import PORT_SPAN
from ktlite_server.ranks import Outcome, RankProcess
from ktlite_wire import shm
from ktlite_wire.distenv import port_free
from ktlite_wire.status import Status

LogEmit = Callable[[int, str, str], None]  # (global rank, stream, line)
logger = logging.getLogger(__name__)


class PodCalls:
    """Running calls on a pod's ranks (mixed into :class:`~ktlite_server.pod.Pod`, which
    sets all of this up)."""

    ranks: list[RankProcess]
    dep: Deployment | None
    lock: asyncio.Lock
    gate: Gate
    generation: int
    group_port: int | None
    lost_groups: dict[int, str]
    last_generation: int
    calls: dict[str, CallHandle]
    calls_total: int
    call_metrics: CallMetrics
    last_active: float  # monotonic time of the last authorized request or call end
    finished: collections.OrderedDict[str, Kept]
    cancelled_early: collections.OrderedDict[str, tuple[Status, str]]
    _sinks: dict[int, dict[str, LogEmit]]
    history: CallHistory

    if TYPE_CHECKING:  # the pod's, which this is mixed into

        async def _settle(self) -> None: ...
        def _idle_ranks(self) -> bool: ...
        async def _heal(self) -> list[Outcome]: ...
        async def _ready_rank(self, local_rank: int, dep: Deployment, restart: bool) -> Outcome: ...
        def _needs_heal(self, r: RankProcess | None) -> bool: ...
        def _heal_later(self) -> None: ...
        def reset(self) -> None: ...

    def next_generation(self) -> None:
        """(Pod 0, MASTER_ADDR) After a failed or stopped call, or a rank restart: the next call
        forms a new process group, on the first port after the last one, cycling through
        MASTER_PORT .. MASTER_PORT + PORT_SPAN - 1, that is free here now (the old group's
        store may still hold its port, and on the local backend other deployments' ports are
        near)."""
        self.generation += 1
        if self.dep is None:
            return
        base = self.dep.master_port
        last = (self.group_port or base) - base
        self.group_port = next(
            (
                base + (last + k) % PORT_SPAN
                for k in range(1, PORT_SPAN)
                if port_free(base + (last + k) % PORT_SPAN)
            ),
            base + self.generation % PORT_SPAN,
        )

    async def run(
        self,
        call_id: str,
        payload: Any,
        path: str | None,
        emit: LogEmit | None,
        restart: bool = False,
        per_rank: dict[str, Any] | None = None,
        generation: int = 0,
        ranks: list[int] | None = None,
        group_port: int | None = None,
    ) -> list[Outcome]:
        """Run one call on every local rank; ``path`` names a shared-memory copy of ``payload``;
        ``generation`` and ``group_port`` name the process group its collectives use (pod 0's
        choice: see :meth:`next_generation`)."""
        if call_id in self.finished:
            return kept(self.finished[call_id])  # duplicate delivery runs once
        if call_id in self.calls:
            handle = self.calls[call_id]
            await handle.wait()
            return handle.outcomes
        handle = CallHandle(call_id)
        early = self.cancelled_early.pop(call_id, None)
        if early is not None:  # the stop overtook the call on its way here: never start it
            handle.stop_kind, handle.stop_reason = early
        self.calls[call_id] = handle
        self.calls_total += 1
        try:
            handle.outcomes = await self._run(
                handle, payload, path, emit, restart, per_rank, generation, ranks, group_port
            )
        finally:
            self._ended(handle, payload, path)
        return handle.outcomes

    def run_now(
        self,
        call_id: str,
        payload: Any,
        emit: LogEmit | None,
        generation: int,
        group_port: int | None,
        then: Callable[[list[Outcome]], None],
    ) -> bool:
        """Start call ``call_id`` at once, without a task, when :meth:`run` would not wait for
        anything: a pod of one rank process that needs no heal, nothing restarting, no process
        group lost, the gate open, the call new, its argument inline. ``then`` gets its
        outcomes in the callback that read the rank's reply (or saw its death), once this pod
        is done with the call. False: nothing started (:meth:`run` takes the call).

        A member's share of a fan-out to one-rank pods is this call: a task, eight coroutine
        frames, a lock, a future and an event per call are about a fifth of such a member's
        CPU (``bench/README.md``, one-rank members)."""
        dep = self.dep
        if (
            dep is None
            or len(self.ranks) != 1
            or self.ranks[0] is None
            or call_id in self.calls
            or call_id in self.finished
            or call_id in self.cancelled_early
            or self.lost_groups
            or self.lock.locked()
            or not self._idle_ranks()
            or memoryview(payload).nbytes > shm.INLINE_MAX
            or not self.gate.try_acquire()  # last: it admits the call
        ):
            return False
        rank = self.ranks[0]
        handle = self.calls[call_id] = CallHandle(call_id)
        self.calls_total += 1
        self.last_generation = generation  # (no group lost: none to clear)
        call = LocalCall(handle, dep, [rank])
        msg = call.prepare(payload, None, None, generation, group_port)[0]
        if emit is not None:
            self._sinks.setdefault(rank.local_rank, {})[call_id] = emit

        def ended(o: Outcome) -> None:
            handle.outcomes = [o]
            try:
                self._sinks.get(rank.local_rank, {}).pop(call_id, None)
                self.reset()  # a rank that died in the call: healed before the next
                self.gate.release()
            finally:
                self._ended(handle, payload, None)
            try:  # (in the rank channel's read callback: nothing may leave it)
                then(handle.outcomes)
            except Exception:  # noqa: BLE001 - logged; the coordinator's watch names the pod
                logger.exception("call %s: answering it failed", call_id)

        call.start_one(rank, msg, ended)
        return True

    def _ended(self, handle: CallHandle, payload: Any, path: str | None) -> None:
        """Call ``handle`` ended here: kept (a duplicate delivery gets its outcomes), counted,
        and in the dashboard's recent calls."""
        call_id = handle.call_id
        self.calls.pop(call_id, None)
        self.last_active = time.monotonic()  # idle from the call's end, not its start
        self.call_metrics.ended(handle.outcomes, self.last_active - handle.started, payload, path)
        handle.ended()
        self.finished[call_id] = keep(handle.outcomes)
        self.history.record(handle)  # the dashboard's recent calls (callhistory.py)
        while len(self.finished) > 256:
            self.finished.popitem(last=False)

    async def _run(
        self,
        handle: CallHandle,
        payload: Any,
        path: str | None,
        emit: LogEmit | None,
        restart: bool,
        per_rank: dict[str, Any] | None = None,
        generation: int = 0,
        ranks: list[int] | None = None,
        group_port: int | None = None,
    ) -> list[Outcome]:
        await self.gate.acquire()  # FIFO: at most the deployment's concurrency run at once
        try:
            return await self._admitted(
                handle, payload, path, emit, restart, per_rank, generation, ranks, group_port
            )
        finally:
            self.gate.release()

    async def _admitted(
        self,
        handle: CallHandle,
        payload: Any,
        path: str | None,
        emit: LogEmit | None,
        restart: bool,
        per_rank: dict[str, Any] | None,
        generation: int,
        ranks: list[int] | None = None,
        group_port: int | None = None,
    ) -> list[Outcome]:
        async with self.lock:  # heals and restarts happen between calls, never under one
            await self._settle()
            dep = self.dep
            if dep is None:
                raise RuntimeError("no code deployed on this pod; call .to() first")
            if restart:  # fresh processes, and a fresh max_restarts budget
                for r in self.ranks:
                    if r is not None:
                        r.restarts = r.streak = 0
                loads = await asyncio.gather(
                    *(self._ready_rank(i, dep, True) for i in range(len(self.ranks)))
                )
                bad = [o for o in loads if o.status is not Status.OK]
            else:
                bad = await self._heal()
            if bad:
                return bad
            if generation != self.last_generation:
                self.lost_groups.clear()  # the call re-forms the group: the restarted ranks join it
            self.last_generation = generation
            if self.lost_groups and dep.config.world_size > 1:
                # a rank died between calls holding a process group and was restarted: its
                # peers (here and on other pods) still hold the old group, and a collective
                # with the fresh process would wait forever. Fail this call at once instead;
                # pod 0 then moves the deployment to a new generation, and the next call runs.
                lost, self.lost_groups = self.lost_groups, {}
                first = dep.config.first_rank(dep.ordinal)
                return [
                    Outcome(
                        first + i,
                        Status.DIED,
                        message=(
                            f"rank {first + i} died between calls ({lost[first + i]}) and was restarted; the "
                            "deployment's process group is formed anew at the next call: call again"
                        ),
                    )
                    if first + i in lost
                    else Outcome(
                        first + i,
                        Status.CANCELLED,
                        message="not started: a rank of this pod was restarted",
                    )
                    for i in range(dep.config.procs(dep.ordinal))
                ]
            if handle.stop_kind:  # cancelled before it started, or while ranks were restarted
                # the ranks keep their groups: pod 0 moves the deployment to a new
                # process-group generation after a stopped call (see Rank.regroup)
                if any(self._needs_heal(r) for r in self.ranks):
                    self._heal_later()
                first = dep.config.first_rank(dep.ordinal)
                return [
                    Outcome(first + i, handle.stop_kind, message=handle.stop_reason)
                    for i in range(dep.config.procs(dep.ordinal))
                    if ranks is None or first + i in ranks
                ]
        call = LocalCall(handle, dep, [r for r in self.ranks if r is not None])
        msg, items, item_at, own_file = call.prepare(
            payload, path, per_rank, generation, group_port
        )
        if emit is not None:
            for r in self.ranks:
                self._sinks.setdefault(r.local_rank, {})[handle.call_id] = emit
        try:
            return await call.fan_in(msg, items, item_at, None if ranks is None else set(ranks))
        finally:
            for sinks in self._sinks.values():
                sinks.pop(handle.call_id, None)
            if own_file is not None:  # its pages are freed off the event loop
                shm.remove_later(own_file)
            self.reset()  # ranks that died or were killed in the call: healed before the next

    def cancel(
        self, call_id: str, kind: Status = Status.CANCELLED, reason: str = "cancelled"
    ) -> bool:
        handle = self.calls.get(call_id)
        if handle is None:
            if call_id not in self.finished:
                self.cancelled_early[call_id] = (kind, reason)
                while len(self.cancelled_early) > 256:
                    self.cancelled_early.popitem(last=False)
            return False
        if not handle.stop_kind:
            handle.stop_kind, handle.stop_reason = kind, reason
        for r in self.ranks:
            if r is not None and call_id in r.running:
                stop_rank(r, call_id, concurrent=self.dep is not None and self.dep.concurrency > 1)
        return True
