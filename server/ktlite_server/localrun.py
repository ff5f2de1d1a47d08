"""A call on the coordinator's own ranks (pod 0's share of a fan-out, or the whole of a call
to one pod): their outcomes as the rows of its answer.

:func:`run_local_now` starts the call at once when the pod need not wait for anything
(``PodCalls.run_now``: a one-rank pod, idle and well, an inline argument) and hands its rows
to ``sink`` (the coordinator's ``arrive``) from the callback that read the rank's reply: no
task, future and coroutine chain for pod 0's own share of every call to one-rank pods.
:func:`run_local` awaits the same, or takes the general path (``Pod.run``: admission, heals,
per-rank items, arguments in shared memory).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ktlite_server import podoutcomes
from ktlite_server.ranks import Outcome, settled
from ktlite_wire import frames
from ktlite_wire.outcome import RankOutcome
from ktlite_wire.plan import CallPlan

if TYPE_CHECKING:
    from ktlite_server.pod import Pod

Emit = Callable[[Any], None]  # puts a frame (bytes or list of parts) on the caller's stream
LogEmit = Callable[[int, str, str], None]


def _log(pod: Pod, plan: CallPlan, emit: Emit) -> LogEmit | None:
    if not plan.stream_logs:
        return None
    name = pod.name

    def log(rank: int, stream: str, line: str) -> None:
        emit(frames.log_frame(rank, name, stream, line))

    return log


async def run_local(
    pod: Pod, plan: CallPlan, payload: Any, path: str | None, emit: Emit
) -> list[RankOutcome]:
    rows: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def sink(got: Any) -> None:  # (a wait given up on is not told: nothing may raise here)
        if not rows.done():
            rows.set_result(got)

    if run_local_now(pod, plan, payload, path, emit, sink) is not None:
        got = await rows
        return got.result() if isinstance(got, asyncio.Future) else got  # type: ignore[no-any-return]
    if plan.generation is None:  # pod 0 (the coordinator) decides
        plan.generation, plan.group_port = pod.generation, pod.group_port
    outs = await pod.run(
        plan.id,
        payload,
        path,
        _log(pod, plan, emit),
        restart=plan.restart,
        per_rank=plan.per_rank,
        generation=plan.generation,
        group_port=plan.group_port,
        ranks=plan.ranks,
    )
    return await _rows(pod, plan, outs)


async def _rows(pod: Pod, plan: CallPlan, outs: list[Outcome]) -> list[RankOutcome]:
    if plan.shm_results:  # the caller maps the files itself: each once its rank wrote it whole
        outs = await settled(outs)
    return podoutcomes.to_wire(pod.name, outs, plan.shm_results)


class LocalNow:
    """A call :func:`run_local_now` started: nothing the coordinator can cancel (its stop
    reaches the ranks through ``Pod.cancel``, as every pod's does)."""

    __slots__ = ()

    def cancel(self) -> None:
        """The coordinator stopped waiting: its answer, if it comes, is not looked at."""


_STARTED = LocalNow()


def run_local_now(
    pod: Pod,
    plan: CallPlan,
    payload: Any,
    path: str | None,
    emit: Emit,
    sink: Callable[[Any], None],
) -> LocalNow | None:
    """The call on this pod's ranks, started now when nothing needs waiting for: ``sink`` gets
    its rows (or a finished future of them, when they had to wait: a result its rank still
    writes, or a failure to form them). None: nothing started (:func:`run_local` takes it)."""
    if path is not None or plan.restart or plan.per_rank is not None or plan.ranks is not None:
        return None
    if plan.generation is None:
        plan.generation, plan.group_port = pod.generation, pod.group_port

    def then(outs: list[Outcome]) -> None:
        if not (plan.shm_results and any(o.feed is not None for o in outs)):
            try:
                sink(podoutcomes.to_wire(pod.name, outs, plan.shm_results))
                return
            except Exception:  # noqa: BLE001 - the task below reports it as run_local would
                pass
        task = asyncio.get_running_loop().create_task(_rows(pod, plan, outs))
        task.add_done_callback(sink)

    started = pod.run_now(
        plan.id, payload, _log(pod, plan, emit), plan.generation, plan.group_port, then
    )
    return _STARTED if started else None
