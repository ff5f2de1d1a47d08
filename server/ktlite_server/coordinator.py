"""Fan-out of one call from the coordinator pod (pod 0) to every pod, and fan-in of results.

The coordinator runs its own ranks and streams the call to the other pods concurrently,
forwarding their log frames to the caller as they arrive. The first failing rank stops the
call everywhere; a timeout does the same. Rank results are never unpickled here: they
pass through as opaque buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import httpx

from ktlite import protocol, shm
from ktlite_server.peers import PeerConnectError, PeerError, PeerPool
from ktlite_server.pod import Pod
from ktlite_server.ranks import Outcome

Emit = Callable[[Any], None]  # puts a frame (bytes or list of parts) on the caller's stream
PodOutcome = tuple[int, str, str, Any, str, float]  # (rank, pod name, status, data, message, at)
REFUSED_GRACE_S = 5.0  # how long a peer may refuse connections before the call fails
STOP_GRACE_S = 10.0  # how long stopped pods get to answer before they are reported stuck


class CallPlan:
    """The ``x-ktlite-call`` header: who runs the call and how."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.id: str = meta["id"]
        self.pods: list[str] = list(meta.get("pods") or [])
        self.names: list[str] = list(meta.get("names") or [])
        self.workers: list[int] | None = meta.get("workers")
        self.timeout: float | None = meta.get("timeout")
        self.stream_logs: bool = bool(meta.get("stream_logs", True))
        self.restart: bool = bool(meta.get("restart", False))
        self.fanout: bool = bool(meta.get("fanout", False))
        self.quorum_timeout: float = float(meta.get("quorum_timeout") or 300.0)
        self.num_proc: int = int(meta.get("num_proc") or 1)
        self.launch_id: str = str(meta.get("launch_id") or "")  # the code the caller deployed
        # same-host mode (local backend): arguments arrive, and results leave, as files
        self.shm: list[Any] | None = meta.get("shm")
        self.shm_results: bool = bool(meta.get("shm_results", False))

    def member_meta(self) -> dict[str, Any]:
        return {"id": self.id, "stream_logs": self.stream_logs, "restart": self.restart, "fanout": False,
                "shm": self.shm, "shm_results": self.shm_results, "launch_id": self.launch_id}


def _pod_outcomes(pod: Pod, outs: list[Outcome], shm_results: bool) -> list[PodOutcome]:
    """Large values wait in shared-memory files: hand over the file when the caller shares
    this host, else map it here to send its bytes."""
    def one(o: Outcome) -> PodOutcome:
        if o.path is None:
            return (o.rank, pod.name, o.status, o.data, o.message, o.at)
        if not os.path.exists(o.path):  # a duplicate request: the first one took the file
            return (o.rank, pod.name, "cancelled", None, f"its result ({o.size} bytes) was already "
                    "delivered to an earlier request with this call id; large results are not kept", o.at)
        data = ("shm", o.path, o.size) if shm_results else shm.take(o.path, o.size)
        return (o.rank, pod.name, o.status, data, o.message, o.at)
    return [one(o) for o in outs]


async def run_local(pod: Pod, plan: CallPlan, payload: Any, path: str | None, emit: Emit) -> list[PodOutcome]:
    log = None
    if plan.stream_logs:
        def log(rank: int, stream: str, line: str) -> None:
            emit(protocol.log_frame(rank, pod.name, stream, line))
    outs = await pod.run(plan.id, payload, path, log, restart=plan.restart)
    return _pod_outcomes(pod, outs, plan.shm_results)


class Coordinator:
    def __init__(self, pod: Pod, token: str, client: httpx.AsyncClient, peers: PeerPool,
                 plan: CallPlan) -> None:
        self.pod = pod
        self.token = token
        self.client = client
        self.peers = peers
        self.plan = plan
        self._stopped = False
        self._lost: set[int] = set()  # pods whose stream failed: no use cancelling there
        self._deadline: float | None = None

    def cancel(self, kind: str, reason: str) -> None:
        """Stop the call on every pod (the caller went away)."""
        if not self._stopped:
            asyncio.get_running_loop().create_task(self._stop(kind, reason))

    def _headers(self, meta: dict[str, Any]) -> dict[str, str]:
        return {protocol.TOKEN_HEADER: protocol.bearer(self.token),
                protocol.VERSION_HEADER: str(protocol.PROTOCOL_VERSION),
                protocol.CALL_HEADER: json.dumps(meta),
                "content-type": "application/octet-stream"}

    async def run(self, payload: Any, path: str | None, emit: Emit) -> list[PodOutcome]:
        plan = self.plan
        targets = plan.workers if plan.workers is not None else list(range(len(plan.pods)))
        if targets == [self.pod.ordinal] and plan.timeout is None:
            return await run_local(self.pod, plan, payload, path, emit)  # nothing to fan out
        missing = await self._quorum(plan, [i for i in targets if i != self.pod.ordinal])
        if missing:
            return missing
        tasks: dict[asyncio.Task[list[PodOutcome]], int] = {}
        loop = asyncio.get_running_loop()
        # remote pods first: their hop is the longer one, so their requests should leave first
        for i in sorted(targets, key=lambda i: i == self.pod.ordinal):
            coro = (run_local(self.pod, plan, payload, path, emit) if i == self.pod.ordinal
                    else self._remote(plan, i, payload, emit))
            tasks[loop.create_task(coro)] = i
        self._deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
        results: list[PodOutcome] = []
        pending = set(tasks)
        while pending:
            remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if not done and not self._stopped:
                await self._stop("timeout", f"the call ran past its timeout of {plan.timeout:g}s")
                continue
            if not done:  # stopped, but these pods never confirmed: report them, stop waiting
                for t in pending:
                    t.cancel()
                    results.extend(self._failed_pod(plan, tasks[t], (
                        f"pod did not confirm the stop within {STOP_GRACE_S:g}s; it may be stuck "
                        "(see its log)"), status="cancelled"))
                break
            for t in done:
                outs = t.result()
                results.extend(outs)
                failed = [o for o in outs if o[2] not in ("ok", "cancelled", "timeout")]
                if failed and not self._stopped and pending:
                    await self._stop("cancelled", f"stopped because rank {failed[0][0]} failed")
        return sorted(results, key=lambda o: o[0])

    async def _stop(self, kind: str, reason: str) -> None:
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
                return  # its stream already failed: a cancel would only wait on a dead pod
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(f"{plan.pods[i]}/cancel/{plan.id}",
                                       params={"kind": kind, "reason": reason, "reset": "true"},
                                       headers=self._headers({"id": plan.id}), timeout=2.0)
        targets = plan.workers if plan.workers is not None else range(len(plan.pods))
        await asyncio.gather(*(stop_one(i) for i in targets))

    async def _quorum(self, plan: CallPlan, remote: list[int]) -> list[PodOutcome]:
        """Every remote pod reachable before any rank starts: a job never runs with fewer
        ranks. Warm keep-alive connections make this free; waits up to quorum_timeout."""
        start = time.monotonic()
        missing = list(remote)
        errors: dict[int, str] = {}
        while missing:
            left = max(0.5, min(5.0, plan.quorum_timeout - (time.monotonic() - start)))
            got = await asyncio.gather(*(self.peers.ensure(plan.pods[i], left) for i in missing),
                                       return_exceptions=True)
            errors = {i: str(e) for i, e in zip(missing, got, strict=True) if isinstance(e, BaseException)}
            missing = list(errors)
            waited = time.monotonic() - start
            # nothing listening at all: the server is gone, and one that restarts has lost the
            # deployment's code anyway; waiting out quorum_timeout would only delay the error
            refused = bool(errors) and all("ConnectionRefused" in m for m in errors.values())
            if not missing or waited >= plan.quorum_timeout or (refused and waited >= REFUSED_GRACE_S):
                break
            await asyncio.sleep(0.2)
        if not missing:
            return []
        names = [plan.names[i] if i < len(plan.names) else plan.pods[i] for i in missing]
        reached = len(plan.pods) - len(missing)
        outs: list[PodOutcome] = []
        targets = plan.workers if plan.workers is not None else range(len(plan.pods))
        for i in targets:
            if i in errors:
                outs += self._failed_pod(plan, i, (
                    f"pod {plan.names[i] if i < len(plan.names) else i} at {plan.pods[i]} was not reachable "
                    f"(waited {time.monotonic() - start:.1f}s of quorum_timeout={plan.quorum_timeout:g}s: "
                    f"{errors[i]}); {reached} of "
                    f"{len(plan.pods)} pods were; no rank started. Check that the pod is running, or "
                    "raise distribute(quorum_timeout=...)"), status="unreachable")
            else:
                outs += self._failed_pod(plan, i, f"not started: pod(s) {', '.join(names)} unreachable",
                                         status="cancelled")
        return outs

    def _failed_pod(self, plan: CallPlan, i: int, message: str, status: str = "died") -> list[PodOutcome]:
        name = plan.names[i] if i < len(plan.names) else f"pod-{i}"
        now = time.time()
        return [(i * plan.num_proc + lr, name, status, None, message, now) for lr in range(plan.num_proc)]

    async def _remote(self, plan: CallPlan, i: int, payload: Any, emit: Emit) -> list[PodOutcome]:
        url = plan.pods[i]
        name = plan.names[i] if i < len(plan.names) else url
        deadline = time.monotonic() + plan.quorum_timeout
        body = memoryview(b"" if plan.shm else payload).cast("B")
        while True:
            try:
                async with self.peers.post(url, "/call", self._headers(plan.member_meta()), body,
                                           connect_timeout=5.0, read_timeout=10.0) as resp:
                    if resp.status != 200:
                        text = (await resp.read()).decode(errors="replace")[:500]
                        with contextlib.suppress(ValueError, AttributeError):
                            text = json.loads(text)["detail"]
                        # 409: the pod lost or replaced the deployment's code; nothing ran there
                        return self._failed_pod(plan, i, f"pod {name} answered HTTP {resp.status}: {text}",
                                                status="stale" if resp.status == 409 else "died")
                    parser = protocol.FrameParser()
                    result: list[PodOutcome] | None = None
                    async for chunk in resp.iter_chunks():
                        for kind, data in parser.feed(chunk):
                            if kind == protocol.LOG:
                                emit(protocol.frame(protocol.LOG, bytes(data)))
                            elif kind == protocol.RESULT:
                                got = protocol.loads(data)["outcomes"]
                                result = [(r, p, s, d, m, at) for r, p, s, d, m, at in got]
                            elif kind == protocol.ERROR:
                                err = json.loads(data)
                                return self._failed_pod(plan, i, f"pod {name}: {err.get('message')}")
                    if result is None:
                        return self._failed_pod(plan, i, f"pod {name} closed the call's stream without a result")
                    return result
            except PeerConnectError as e:
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.2)  # not started yet: retrying the connection is safe
                    continue
                self._lost.add(i)
                return self._failed_pod(plan, i, f"pod {name} at {url} was not reachable within the quorum "
                                                 f"timeout of {plan.quorum_timeout:g}s ({e}); check that it is running")
            except TimeoutError:
                self._lost.add(i)
                return self._failed_pod(plan, i, f"pod {name} stopped responding (no data or heartbeat for 10s); "
                                                 "the pod may have died or be overloaded")
            except (PeerError, protocol.ProtocolError) as e:
                self._lost.add(i)
                return self._failed_pod(plan, i, f"lost the connection to pod {name} during the call: {e}")
