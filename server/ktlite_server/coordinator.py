"""Fan-out of one call from the coordinator pod (pod 0) to every pod, and fan-in of results.

The coordinator runs its own ranks and streams the call to the other pods concurrently,
forwarding their log frames to the caller as they arrive. The first failing rank stops the
call everywhere; a timeout does the same. Rank results are never unpickled here: they
pass through as opaque buffers.

With a call tree (the plan's ``tree``: :mod:`ktlite_wire.calltree`) the coordinator sends
the call to its children only, and each child coordinates its own subtree the same way: it
waits for its children's quorum, runs its ranks, relays logs, stops and results up and
down. A child that fails or goes silent is reported with every rank of its subtree (its
own as failed, the ones below it as not reached); those below it stop on their own when the
stream to it breaks, and are told to stop as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Callable
from typing import Any

from ktlite_server import linkclient, memberanswer, quorum
from ktlite_server.localrun import LocalNow, run_local, run_local_now
from ktlite_server.peers import PeerConnectError, PeerError, PeerPool, error_text
from ktlite_server.pod import Pod
from ktlite_wire import calltree, frames, headers, heartbeat, linkframes
from ktlite_wire.errors import ErrorCode, ProtocolError
from ktlite_wire.headers import ERROR_CODE_HEADER
from ktlite_wire.outcome import CallResult, RankOutcome, Subtree
from ktlite_wire.plan import CallPlan
from ktlite_wire.status import Status
from ktlite_wire.version import PROTOCOL_VERSION

Emit = Callable[[Any], None]  # puts a frame (bytes or list of parts) on the caller's stream
PodOutcome = RankOutcome
STOP_GRACE_S = 10.0  # how long stopped pods get to answer before they are reported stuck
# silence from another pod this long (no frame, no heartbeat) means it is gone; this pod's
# KTLITE_SILENCE_TIMEOUT (kt.Compute(env=...)), read once: a bad value stops the server here
SILENCE_S = heartbeat.silence_timeout()


Answer = list[PodOutcome] | Subtree  # a pod's answer: its ranks' outcomes, or its result


def _failed(got: asyncio.Future[Answer] | Answer) -> bool:
    """Whether a pod's answer (or its finished task) needs the coordinator at once: a
    failure, or no answer."""
    if isinstance(got, asyncio.Future):
        if got.cancelled() or got.exception() is not None:
            return True
        got = got.result()
    if isinstance(got, Subtree):
        return got.failed is not None
    return any(o.status.failed for o in got)


class Coordinator:
    def __init__(self, pod: Pod, token: str, peers: PeerPool, plan: CallPlan) -> None:
        self.pod = pod
        self.token = token
        self.peers = peers
        self.plan = plan
        self._stopped = False
        self._stop_reason = ""
        self._lost: set[int] = set()  # pods whose stream failed: no use cancelling there
        self._deadline: float | None = None
        self.started = False  # a rank may have started (False: the call can be sent again)
        self._wake: asyncio.Event | None = None
        self._shared_headers: dict[str, str] | None = None  # every member's, when they are alike
        self._run: bytes | None = None  # and the RUN they are sent over a link
        # the pods this one sends the call to: every target (flat), or its children (a tree)
        self._members: list[int] = []
        self._subtrees: dict[int, list[int]] = {}  # a tree: each child's subtree, itself first

    def cancel(self, kind: Status, reason: str) -> None:
        """Stop the call on every pod (the caller went away, or asked to)."""
        if not self._stopped:
            if not self.started:  # still waiting for the quorum: nothing to stop but the wait
                self._stopped, self._stop_reason = True, reason
                if self._wake is not None:
                    self._wake.set()
                return
            asyncio.get_running_loop().create_task(self._stop(kind, reason))

    def _headers(self, meta: dict[str, Any] | str) -> dict[str, str]:
        return {
            headers.TOKEN_HEADER: headers.bearer(self.token),
            headers.VERSION_HEADER: str(PROTOCOL_VERSION),
            headers.CALL_HEADER: meta if isinstance(meta, str) else json.dumps(meta),
            "content-type": "application/octet-stream",
        }

    async def run(self, payload: Any, path: str | None, emit: Emit) -> CallResult:
        """The call on this pod's targets: this pod's own outcomes (and those it made up for
        pods that failed), and the results its members answered, passed on undecoded."""
        plan = self.plan
        if plan.generation is None:
            plan.generation, plan.group_port = self.pod.generation, self.pod.group_port
        targets = plan.workers if plan.workers is not None else list(plan.ordinals())
        me = self.pod.ordinal
        if targets == [me] and plan.timeout is None:
            self.started = True
            return CallResult(await run_local(self.pod, plan, payload, path, emit))  # no fan-out
        if plan.tree:
            subtrees = calltree.split([i for i in targets if i != me], plan.tree)
            self._subtrees = {sub[0]: sub for sub in subtrees}
            self._members = ([me] if me in targets else []) + list(self._subtrees)
        else:
            self._members = targets
        missing = await self._quorum(plan, [i for i in self._members if i != me], emit)
        if missing:
            return CallResult(missing, started=False)
        if self._stopped:  # cancelled while waiting for the quorum: no rank started
            return CallResult(
                [
                    o
                    for i in self._members
                    for o in self._failed_pod(
                        plan, i, f"not started: {self._stop_reason}", status=Status.CANCELLED
                    )
                ],
                started=False,
            )
        self.started = True
        # each pod's answer, until it arrives: a task, or a member's answer fed by its link
        pending: dict[int, asyncio.Future[Answer] | memberanswer.MemberAnswer | LocalNow] = {}
        # the answers in, not yet taken: (ordinal, a finished task or the answer itself)
        arrived: list[tuple[int, Any]] = []
        wake = asyncio.Event()

        def arrive(i: int, got: Any) -> None:
            # the loop below wakes once every pod answered, or at once for a failure (the
            # others are stopped): not once per pod, and not asyncio.wait over every pending
            # pod again after each arrival (quadratic in the pods of a flat fan-out)
            arrived.append((i, got))
            if len(arrived) == left or _failed(got):
                wake.set()

        loop = asyncio.get_running_loop()
        left = len(self._members)  # one answer each (one may come before the loop below ends)
        run = linkframes.plan_run(plan)  # what a member that relays to no other pod is sent
        body = None if run is None else memoryview(payload).cast("B")
        # remote pods first: their hop is the longer one, so their requests should leave first
        for i in sorted(self._members, key=lambda i: i == me):
            if i == me:  # its own ranks: started at once when nothing needs waiting for
                started = run_local_now(
                    self.pod, plan, payload, path, emit, functools.partial(arrive, i)
                )
                if started is not None:
                    pending[i] = started
                    continue
            if i != me and run and body is not None and len(self._subtrees.get(i, (i,))) == 1:
                # a leaf, over its open link: no task, no future (memberanswer)
                sent = memberanswer.send(
                    self.peers,
                    plan.url(i),
                    plan.name(i),
                    run,
                    body,
                    SILENCE_S,
                    emit,
                    functools.partial(self._member_failed, plan, i),
                    functools.partial(self._remote, plan, i, payload, emit),
                    functools.partial(arrive, i),
                )
                if sent is not None:
                    pending[i] = sent
                    continue
            coro = (
                run_local(self.pod, plan, payload, path, emit)
                if i == me
                else self._remote(plan, i, payload, emit)
            )
            task = pending[i] = loop.create_task(coro)
            task.add_done_callback(functools.partial(arrive, i))
        self._deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
        results: list[PodOutcome] = []
        passed: dict[int, Subtree] = {}  # the members' own results, by ordinal: not decoded
        while left:
            if not arrived:
                wake.clear()
                remaining = (
                    None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), remaining)
                if arrived:
                    continue
                if not self._stopped:
                    await self._stop(
                        Status.TIMEOUT, f"the call ran past its timeout of {plan.timeout:g}s"
                    )
                    continue
                # stopped, but these pods never confirmed: report them, stop waiting
                for i, waiting in pending.items():
                    waiting.cancel()
                    results.extend(
                        self._failed_pod(
                            plan,
                            i,
                            (
                                f"pod did not confirm the stop within {STOP_GRACE_S:g}s; it "
                                "may be stuck (see its log)"
                            ),
                            status=Status.CANCELLED,
                        )
                    )
                break
            batch = arrived.copy()
            arrived.clear()
            for i, got in batch:
                left -= 1
                del pending[i]
                if isinstance(got, asyncio.Future):
                    got = got.result()
                if isinstance(got, Subtree):
                    passed[i] = got
                    failed = got.failed
                else:
                    results.extend(got)
                    failed = min((o.rank for o in got if o.status.failed), default=None)
                # even when it is the last to arrive: the other pods must drop the process
                # groups their ranks share with the failed one, or the next collective hangs
                if failed is not None and not self._stopped:
                    await self._stop(Status.CANCELLED, f"stopped because rank {failed} failed")
        results.sort(key=lambda o: o.rank)
        return CallResult(results, subtrees=[passed[i] for i in sorted(passed)])

    async def _stop(self, kind: Status, reason: str) -> None:
        """Stop the call on every pod of it: running ones cancel, finished ones drop their
        process groups. Pods get STOP_GRACE_S to confirm before they are reported as stuck."""
        self._stopped = True
        self._deadline = time.monotonic() + STOP_GRACE_S
        plan = self.plan

        async def stop_one(i: int) -> None:
            if i == self.pod.ordinal:
                if not self.pod.cancel(plan.id, kind, reason):
                    self.pod.reset()
                return
            if i in self._lost:
                # its stream already failed: a cancel would only wait on a dead pod. In a tree
                # the pods it relayed to stop when their stream to it breaks; tell them too
                below = calltree.split(self._subtrees.get(i, [i])[1:], plan.tree)
                await asyncio.gather(*(cancel(sub[0]) for sub in below))
                return
            await cancel(i)

        async def cancel(i: int) -> None:
            link = linkclient.open_link(self.peers, plan.url(i))
            if link is not None:  # a STOP on its link: no request, nothing to wait for
                link.stop(linkframes.Stop(plan.id, kind, reason, True))
                return
            with contextlib.suppress(PeerError):
                await self.peers.request(
                    "POST",
                    f"{plan.url(i)}/cancel/{plan.id}",
                    params={"kind": kind.value, "reason": reason, "reset": "true"},
                    headers=self._headers({"id": plan.id}),
                    timeout=2.0,
                )

        await asyncio.gather(*(stop_one(i) for i in self._members))

    async def _quorum(self, plan: CallPlan, remote: list[int], emit: Emit) -> list[PodOutcome]:
        """Every remote pod reachable before any rank starts (``quorum.wait``)."""
        missing = [remote[k] for k in self.peers.stale([plan.url(i) for i in remote])]
        if not missing:
            return []  # calls back to back: every peer answered within the last seconds
        self._wake = asyncio.Event()
        return await quorum.wait(
            self.peers,
            plan,
            missing,
            self._members,
            emit,
            self._wake,
            self._is_stopped,
            self._failed_pod,
        )

    def _is_stopped(self) -> bool:
        return self._stopped

    def _member_failed(
        self, plan: CallPlan, i: int, message: str, status: Status, lost: bool
    ) -> list[PodOutcome]:
        if lost:  # its stream broke: no use sending it a stop
            self._lost.add(i)
        return self._failed_pod(plan, i, message, status)

    def _failed_pod(
        self, plan: CallPlan, i: int, message: str, status: Status = Status.DIED
    ) -> list[PodOutcome]:
        """Every rank of pod ``i`` ended with ``status``; in a tree, the ranks of the pods it
        relays to are not reached (or their outcome was lost with it)."""
        name = plan.name(i)
        now = time.time()
        outs = [
            RankOutcome(r, name, status, None, message, now)
            for r in plan.pod_ranks(i)
            if plan.ranks is None or r in plan.ranks
        ]
        below = self._subtrees.get(i, [i])[1:]
        if below and status is not Status.CANCELLED:
            status = Status.UNREACHABLE
            message = (
                f"not reached, or its outcome was lost: pod {name}, which relays the call to "
                f"this pod, failed ({message[:300]})"
            )
        for j in below:
            outs += [
                RankOutcome(r, plan.name(j), status, None, message, now)
                for r in plan.pod_ranks(j)
                if plan.ranks is None or r in plan.ranks
            ]
        return outs

    async def _remote(
        self, plan: CallPlan, i: int, payload: Any, emit: Emit
    ) -> list[PodOutcome] | Subtree:
        """Pod ``i``'s (and its subtree's) answer, passed on as it came, or its ranks'
        outcomes made up here when it failed."""
        url = plan.url(i)
        name = plan.name(i)
        deadline = time.monotonic() + plan.quorum_timeout
        subtree = self._subtrees.get(i, [i])
        if len(subtree) > 1:  # a child that relays the call to its subtree
            per_rank, body = calltree.subtree_body(plan, subtree, payload)
            member_headers = self._headers(calltree.relay_header(plan, subtree, per_rank))
        elif plan.per_rank is not None:  # each pod's plan names its own items
            meta, body = plan.member_body(i, payload)
            member_headers = self._headers(meta)
        else:  # the same plan for every member: encoded once per call
            meta, body = plan.member_body(i, payload)
            if self._shared_headers is None:
                self._shared_headers = self._headers(meta)
                self._run = linkframes.plan_run(plan)  # over a link: a RUN, not the plan
            member_headers = self._shared_headers
        while True:
            try:
                # over the pool's link to that pod (an HTTP request when the body is large)
                async with linkclient.post(
                    self.peers,
                    url,
                    "/call",
                    member_headers,
                    body,
                    connect_timeout=5.0,
                    read_timeout=SILENCE_S,
                    run=self._run if len(subtree) == 1 else None,
                ) as resp:
                    if resp.status != 200:
                        text = error_text(await resp.read())
                        # the pod lost or replaced the deployment's code: nothing ran there
                        stale = ErrorCode.parse(resp.headers.get(ERROR_CODE_HEADER)) in (
                            ErrorCode.NOT_DEPLOYED,
                            ErrorCode.REDEPLOYED,
                        )
                        return self._failed_pod(
                            plan,
                            i,
                            f"pod {name} answered HTTP {resp.status}: {text}",
                            status=Status.STALE if stale else Status.DIED,
                        )
                    parser = frames.FrameParser()
                    result: Subtree | None = None
                    async for chunk in resp.iter_chunks():
                        for kind, data in parser.feed(chunk):
                            if kind == frames.LOG:
                                emit(frames.frame(frames.LOG, bytes(data)))
                            elif kind == frames.NOTICE and len(subtree) > 1:
                                # a relay waits for pods of its subtree: the caller may know
                                # they were replaced (a skip notice numbers that pod's frames,
                                # not ours: not passed on)
                                notice = frames.Notice.decode(data)
                                if notice.kind == "waiting":
                                    emit(notice.encode())
                            elif kind == frames.RESULT:  # its head read, its rows passed on
                                result = Subtree.peek(data)
                            elif kind == frames.ERROR:
                                err = frames.decode_error(data)
                                return self._failed_pod(plan, i, f"pod {name}: {err.message}")
                    done = getattr(resp, "done", None)
                    if done is not None:  # a RUN's outcomes
                        return linkframes.read_done(done)
                    if result is None:
                        return self._failed_pod(
                            plan, i, f"pod {name} closed the call's stream without a result"
                        )
                    return result
            except PeerConnectError as e:
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.2)  # not started yet: retrying the connection is safe
                    continue
                self._lost.add(i)
                return self._failed_pod(
                    plan,
                    i,
                    f"pod {name} at {url} was not reachable within the quorum "
                    f"timeout of {plan.quorum_timeout:g}s ({e}); check that it is running",
                )
            except TimeoutError:
                self._lost.add(i)
                return self._failed_pod(
                    plan,
                    i,
                    f"pod {name} stopped responding (no data or heartbeat for {SILENCE_S:g}s); "
                    "the pod may have died or be overloaded",
                )
            except (PeerError, ProtocolError) as e:
                self._lost.add(i)
                return self._failed_pod(
                    plan, i, f"lost the connection to pod {name} during the call: {e}"
                )
