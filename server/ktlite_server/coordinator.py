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
import math
import os
import time
from collections.abc import Callable
from typing import Any

from ktlite import protocol, rankdata, shm
from ktlite_server.peers import PeerConnectError, PeerError, PeerPool
from ktlite_server.pod import Pod
from ktlite_server.ranks import Outcome

Emit = Callable[[Any], None]  # puts a frame (bytes or list of parts) on the caller's stream
PodOutcome = tuple[int, str, str, Any, str, float]  # (rank, pod name, status, data, message, at)
REFUSED_GRACE_S = 5.0  # how long a peer may refuse connections before the call fails
NOTICE_AFTER_S = 2.0  # the caller hears of pods not reachable yet after this, and this often
STOP_GRACE_S = 10.0  # how long stopped pods get to answer before they are reported stuck


class CallPlan:
    """The ``x-ktlite-call`` header: who runs the call and how."""

    def __init__(self, meta: Any) -> None:
        """Validate every field: a bad header is the caller's fault (400), never a crash."""
        if not isinstance(meta, dict):
            raise ValueError("the call plan must be a JSON object")
        self.id = _str(meta, "id", required=True)
        self.pods = _list(meta, "pods", str)
        self.names = _list(meta, "names", str)
        workers = meta.get("workers")
        self.workers: list[int] | None = None if workers is None else _list(meta, "workers", int)
        if self.workers is not None and (not self.workers or any(
                not 0 <= w < len(self.pods) for w in self.workers)):
            raise ValueError(f"workers={workers!r} must be pod indices between 0 and {len(self.pods) - 1}")
        self.timeout = _number(meta, "timeout", None)
        self.stream_logs = bool(meta.get("stream_logs", True))
        self.restart = bool(meta.get("restart", False))
        self.fanout = bool(meta.get("fanout", False))
        if self.fanout and not self.pods:
            raise ValueError("a fan-out call needs its pods")
        if self.names and len(self.names) != len(self.pods):
            raise ValueError("names and pods differ in length")
        self.quorum_timeout = _number(meta, "quorum_timeout", 300.0) or 300.0
        num_proc = meta.get("num_proc") or 1
        sizes = num_proc if isinstance(num_proc, list) else [num_proc] * max(1, len(self.pods))
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096 for n in sizes):
            raise ValueError(f"num_proc={num_proc!r} must be a whole number between 1 and 4096, or one per pod")
        if isinstance(num_proc, list) and self.pods and len(num_proc) != len(self.pods):
            raise ValueError(f"num_proc has {len(num_proc)} entries for {len(self.pods)} pods")
        self.num_proc = num_proc
        self.sizes: list[int] = sizes  # ranks of each pod
        self.launch_id = _str(meta, "launch_id")  # the code the caller deployed
        # same-host mode (local backend): arguments arrive, and results leave, as files
        shm_arg = meta.get("shm")
        if shm_arg is not None and not (isinstance(shm_arg, list) and len(shm_arg) == 2):
            raise ValueError("shm must be [path, size]")
        self.shm: list[Any] | None = shm_arg
        self.shm_results = bool(meta.get("shm_results", False))
        # seconds a call waits for its caller to re-attach after the stream broke (callers
        # behind a proxy ask for it); 0: a closed stream cancels the call at once
        self.reattach = min(_number(meta, "reattach", 0.0) or 0.0, 120.0)
        ranks = meta.get("ranks")
        self.ranks: list[int] | None = None if ranks is None else _list(meta, "ranks", int)
        # the process-group generation, set by pod 0 (members get it in their plan)
        generation = meta.get("generation")
        if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)
                                       or generation < 0):
            raise ValueError(f"generation={generation!r} must be a whole number")
        self.generation: int | None = generation
        group_port = meta.get("group_port")  # its MASTER_PORT, picked by pod 0 (None: the first one)
        if group_port is not None and (isinstance(group_port, bool) or not isinstance(group_port, int)
                                       or not 0 < group_port < 65536):
            raise ValueError(f"group_port={group_port!r} must be a TCP port")
        self.group_port: int | None = group_port
        # a per-rank call: the body is the shared message, then each rank's items
        per_rank = meta.get("per_rank")
        self.per_rank: dict[str, Any] | None = None if per_rank is None else rankdata.check_plan(per_rank)

    def name(self, i: int) -> str:
        """Pod ``i``'s name (its URL when the caller sent no names)."""
        return self.names[i] if self.names else self.pods[i]

    def pod_ranks(self, i: int) -> range:
        """The global ranks of pod ``i``."""
        start = sum(self.sizes[:i])
        return range(start, start + self.sizes[i])

    def member_meta(self, per_rank: dict[str, Any] | None = None) -> dict[str, Any]:
        meta = {"id": self.id, "stream_logs": self.stream_logs, "restart": self.restart, "fanout": False,
                "shm": self.shm, "shm_results": self.shm_results, "launch_id": self.launch_id,
                "num_proc": self.num_proc, "generation": self.generation, "group_port": self.group_port,
                "ranks": self.ranks}
        if per_rank is not None:
            meta["per_rank"] = per_rank
        return meta

    def member_body(self, i: int, payload: Any) -> tuple[dict[str, Any], Any]:
        """What pod ``i`` is sent: the call plan and body, a per-rank call's cut to the shared
        message and that pod's own items (from shared memory: just their offsets)."""
        if self.per_rank is None:
            return self.member_meta(), memoryview(b"" if self.shm else payload).cast("B")
        ranks = self.pod_ranks(i)
        slices = rankdata.pod_slices(self.per_rank, ranks)
        shared = self.per_rank["shared"]
        if self.shm:  # every pod maps the same file: offsets only
            return self.member_meta({"shared": shared, "items": slices, "base": ranks.start}), memoryview(b"")
        view = memoryview(payload).cast("B")
        body, items, pos = [view[:shared]], [], shared
        for off, n in slices:
            body.append(view[off:off + n])
            items.append([pos, n])
            pos += n
        return self.member_meta({"shared": shared, "items": items, "base": ranks.start}), body


def _str(meta: dict[str, Any], key: str, required: bool = False) -> str:
    value = meta.get(key)
    if value in (None, "") and not required:
        return ""
    if not isinstance(value, str) or not value or len(value) > 200:
        raise ValueError(f"{key} must be a {'non-empty ' if required else ''}string of at most 200 characters")
    return value


def _list(meta: dict[str, Any], key: str, kind: type) -> list[Any]:
    value = meta.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool)
                                              for v in value):
        raise ValueError(f"{key} must be a list of {kind.__name__}")
    return value


def _number(meta: dict[str, Any], key: str, default: float | None) -> float | None:
    value = meta.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{key}={value!r} must be a positive number of seconds")
    return float(value)


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
    if plan.generation is None:  # pod 0 (the coordinator) decides
        plan.generation, plan.group_port = pod.generation, pod.group_port
    outs = await pod.run(plan.id, payload, path, log, restart=plan.restart, per_rank=plan.per_rank,
                         generation=plan.generation, group_port=plan.group_port, ranks=plan.ranks)
    return _pod_outcomes(pod, outs, plan.shm_results)


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

    def cancel(self, kind: str, reason: str) -> None:
        """Stop the call on every pod (the caller went away, or asked to)."""
        if not self._stopped:
            if not self.started:  # still waiting for the quorum: nothing to stop but the wait
                self._stopped, self._stop_reason = True, reason
                if self._wake is not None:
                    self._wake.set()
                return
            asyncio.get_running_loop().create_task(self._stop(kind, reason))

    def _headers(self, meta: dict[str, Any]) -> dict[str, str]:
        return {protocol.TOKEN_HEADER: protocol.bearer(self.token),
                protocol.VERSION_HEADER: str(protocol.PROTOCOL_VERSION),
                protocol.CALL_HEADER: json.dumps(meta),
                "content-type": "application/octet-stream"}

    async def run(self, payload: Any, path: str | None, emit: Emit) -> list[PodOutcome]:
        plan = self.plan
        if plan.generation is None:
            plan.generation, plan.group_port = self.pod.generation, self.pod.group_port
        targets = plan.workers if plan.workers is not None else list(range(len(plan.pods)))
        if targets == [self.pod.ordinal] and plan.timeout is None:
            self.started = True
            return await run_local(self.pod, plan, payload, path, emit)  # nothing to fan out
        missing = await self._quorum(plan, [i for i in targets if i != self.pod.ordinal], emit)
        if missing:
            return missing
        if self._stopped:  # cancelled while waiting for the quorum: no rank started
            return [o for i in targets for o in self._failed_pod(
                plan, i, f"not started: {self._stop_reason}", status="cancelled")]
        self.started = True
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
                # even when it is the last to arrive: the other pods must drop the process
                # groups their ranks share with the failed one, or the next collective hangs
                if failed and not self._stopped:
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
            with contextlib.suppress(PeerError):
                await self.peers.request("POST", f"{plan.pods[i]}/cancel/{plan.id}",
                                         params={"kind": kind, "reason": reason, "reset": "true"},
                                         headers=self._headers({"id": plan.id}), timeout=2.0)
        targets = plan.workers if plan.workers is not None else range(len(plan.pods))
        await asyncio.gather(*(stop_one(i) for i in targets))

    async def _quorum(self, plan: CallPlan, remote: list[int], emit: Emit) -> list[PodOutcome]:
        """Every remote pod reachable before any rank starts: a job never runs with fewer
        ranks. Warm keep-alive connections make this free; waits up to quorum_timeout. Every
        NOTICE_AFTER_S the caller hears which pods are missing (it may know they were
        replaced, and cancel); a cancel ends the wait at once."""
        missing = [i for i in remote if not self.peers.fresh(plan.pods[i])]
        if not missing:
            return []  # calls back to back: every peer answered within the last seconds
        start = time.monotonic()
        errors: dict[int, str] = {}
        noticed = start
        self._wake = asyncio.Event()
        while missing and not self._stopped:
            left = max(0.5, min(NOTICE_AFTER_S, plan.quorum_timeout - (time.monotonic() - start)))
            probes = asyncio.ensure_future(asyncio.gather(
                *(self.peers.ensure(plan.pods[i], left) for i in missing), return_exceptions=True))
            woken = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({probes, woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if not probes.done():  # cancelled mid-probe
                probes.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probes
                break
            got = probes.result()
            errors = {i: str(e) for i, e in zip(missing, got, strict=True) if isinstance(e, BaseException)}
            missing = list(errors)
            waited = time.monotonic() - start
            # nothing listening at all: the server is gone, and one that restarts has lost the
            # deployment's code anyway; waiting out quorum_timeout would only delay the error
            refused = bool(errors) and all("ConnectionRefused" in m for m in errors.values())
            if not missing or waited >= plan.quorum_timeout or (refused and waited >= REFUSED_GRACE_S):
                break
            if time.monotonic() - noticed >= NOTICE_AFTER_S:
                noticed = time.monotonic()
                names = ", ".join(plan.name(i) for i in missing)
                emit(protocol.notice_frame(
                    "waiting", f"waiting for pod(s) {names} to be reachable ({waited:.0f}s of "
                    f"quorum_timeout={plan.quorum_timeout:g}s; no rank has started)",
                    pods=missing, waited=waited))
            await asyncio.sleep(0.2)
        if not missing or self._stopped:
            return []
        names = [plan.name(i) for i in missing]
        reached = len(plan.pods) - len(missing)
        outs: list[PodOutcome] = []
        targets = plan.workers if plan.workers is not None else range(len(plan.pods))
        for i in targets:
            if i in errors:
                outs += self._failed_pod(plan, i, (
                    f"pod {plan.name(i)} at {plan.pods[i]} was not reachable "
                    f"(waited {time.monotonic() - start:.1f}s of quorum_timeout={plan.quorum_timeout:g}s: "
                    f"{errors[i]}); {reached} of "
                    f"{len(plan.pods)} pods were; no rank started. Check that the pod is running, or "
                    "raise distribute(quorum_timeout=...)"), status="unreachable")
            else:
                outs += self._failed_pod(plan, i, f"not started: pod(s) {', '.join(names)} unreachable",
                                         status="cancelled")
        return outs

    def _failed_pod(self, plan: CallPlan, i: int, message: str, status: str = "died") -> list[PodOutcome]:
        name = plan.name(i)
        now = time.time()
        return [(r, name, status, None, message, now) for r in plan.pod_ranks(i)
                if plan.ranks is None or r in plan.ranks]

    async def _remote(self, plan: CallPlan, i: int, payload: Any, emit: Emit) -> list[PodOutcome]:
        url = plan.pods[i]
        name = plan.name(i)
        deadline = time.monotonic() + plan.quorum_timeout
        meta, body = plan.member_body(i, payload)
        while True:
            try:
                async with self.peers.post(url, "/call", self._headers(meta), body,
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
