"""One pod's runtime: its rank processes, the loaded deployment, and the calls it runs.

A call on a pod runs on all its local ranks at once (up to the deployment's concurrency of
calls, admitted in order). When one rank fails, its siblings in the call are interrupted and
keep their processes and state; one still running after INTERRUPT_GRACE_S (blocked in a
collective) is killed. Only dead ranks are restarted, so the next call finds a healthy pod.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ktlite import rankdata, shm
from ktlite.spec import DistributedConfig, distributed_env, port_free
from ktlite_server.engine import Engine, EngineError
from ktlite_server.monarchhost import MonarchHost
from ktlite_server.peers import PeerPool
from ktlite_server.rank import PORT_SPAN
from ktlite_server.ranks import Outcome, RankGone, RankProcess
from ktlite_server.raynode import RayNode
from ktlite_server.usage import Apps, GpuQuery, ProcessUsage, rank_gpu_summary, visible

logger = logging.getLogger(__name__)
LogEmit = Callable[[int, str, str], None]  # (global rank, stream, line)
_RESERVED = ("KTLITE_TOKEN",)

# debugging aid (and the per-rank tests): the pod's log says what each call brought
LOG_BODIES = os.environ.get("KTLITE_LOG_CALL_BODIES", "") not in ("", "0")

DEFAULT_STUCK_AFTER_S = 600.0  # a rank busy with one call longer than this is reported stuck


_PER_LAUNCH = ("KTLITE_LAUNCH_ID", "TORCHELASTIC_RUN_ID")


def _layout(env: dict[str, str]) -> dict[str, str]:
    """The part of a rank env that, when changed, needs a fresh process (not per-launch ids)."""
    return {k: v for k, v in env.items() if k not in _PER_LAUNCH}


@dataclass
class Deployment:
    """What ``POST /deploy`` installs on a pod (all plain data; the code stays pickled bytes)."""

    launch_id: str
    bundle: bytes
    kind: str
    init: bytes | None
    sources: dict[str, tuple[str, str, bool]]
    config: DistributedConfig
    pod_ips: list[str]
    ordinal: int
    master_port: int
    max_restarts: int = 3
    cpus: float | None = None
    load_timeout: float = 300.0
    concurrency: int = 1  # calls each rank process runs at once
    engine: dict[str, Any] | None = None  # distribute("ray"/"monarch"): this pod's engine (ktlite.engines)
    single: bool = False  # not distributed: a call returns one value, not a list by rank


INTERRUPT_GRACE_S = 1.0  # a call stopped on its own has this long to end before its rank is killed


class Gate:
    """Admits at most ``limit`` calls at once, the others in arrival order (FIFO). A deploy
    closes it, waits for the running calls to end, and reopens it with the new limit."""

    def __init__(self, limit: int = 1) -> None:
        self.limit = limit
        self.active = 0
        self._closed = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._idle: asyncio.Event | None = None

    async def acquire(self) -> None:
        if not self._closed and self.active < self.limit and not self._waiters:
            self.active += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # admitted just as the waiter went away: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(future)
            raise

    def release(self) -> None:
        self.active -= 1
        if self.active == 0 and self._idle is not None:
            self._idle.set()
        self._wake()

    def _wake(self) -> None:
        while not self._closed and self.active < self.limit and self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                self.active += 1
                future.set_result(None)

    async def close(self) -> None:
        """Admit nothing new and wait until no call runs."""
        self._closed = True
        while self.active:
            self._idle = asyncio.Event()
            await self._idle.wait()
        self._idle = None

    def open(self, limit: int) -> None:
        self.limit, self._closed = max(1, limit), False
        self._wake()


@dataclass
class Colocated:
    """A second function/class loaded into the same rank processes (``kt.cls(B).to(remote_a)``)."""

    bundle: bytes
    kind: str
    init: bytes | None
    sources: dict[str, tuple[str, str, bool]]


@dataclass
class _CallHandle:
    call_id: str
    stop_kind: str | None = None
    stop_reason: str = ""
    started: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: list[Outcome] = field(default_factory=list)


ENGINE_KINDS: dict[str, type[Engine]] = {"ray": RayNode, "monarch": MonarchHost}


class Pod:
    def __init__(self, name: str, ordinal: int, procs: int = 1) -> None:
        self.name = name
        self.ordinal = ordinal
        self.base_env = {k: v for k, v in os.environ.items() if k not in _RESERVED}
        self.ranks: list[RankProcess] = []
        self.dep: Deployment | None = None
        self.ready_launch: str | None = None  # the launch every rank loaded (readiness)
        # colocated targets by name: kept across redeploys of the primary code, loaded into
        # every rank process this pod starts (a restarted rank gets them all back)
        self.colocated: dict[str, Colocated] = {}
        self.lock = asyncio.Lock()
        self.gate = Gate(1)  # calls at once on this pod (the deployment's concurrency)
        self.order = asyncio.Lock()  # pod 0: a distributed deployment's calls, one at a time, FIFO
        self.generation = 0  # pod 0: the process-group generation (bumped after a failed call)
        self.group_port: int | None = None  # pod 0: that generation's MASTER_PORT (None: the deployment's)
        self.restarted: list[int] = []  # ranks restarted since restart_failed() last asked
        self.lost_groups: dict[int, str] = {}  # ranks that died idle holding a process group
        self.last_generation = 0  # the process-group generation of the last call run here
        self.calls: dict[str, _CallHandle] = {}
        self.calls_total = 0
        self.finished: collections.OrderedDict[str, list[Outcome]] = collections.OrderedDict()
        self.cancelled_early: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._sinks: dict[int, dict[str, LogEmit]] = {}  # local rank -> call id -> its log stream
        self._prespawn = procs
        self._healing: asyncio.Task[None] | None = None
        self._heal_lock = asyncio.Lock()
        self.engine: Engine | None = None  # distribute("ray"/"monarch"): this pod's engine
        self.peers = PeerPool()  # this pod's connections to the others (the server gives it the token)
        self.last_active = time.monotonic()  # the last authorized request (--inactivity-ttl)
        self.engine_failed: dict[str, str] | None = None  # {"launch_id", "message"} (in /health)
        self.usage = ProcessUsage()
        self.gpu_query = GpuQuery()
        # the deployment's pod addresses, rewritten at every deploy: ktlite.distributed.pod_ips()
        self.pod_ips_file = os.path.join(tempfile.gettempdir(), f"ktlite-pod-ips-{os.getpid()}.json")

    # ---- rank env & processes ----------------------------------------------------------

    def rank_env(self, dep: Deployment, local_rank: int) -> dict[str, str]:
        env = distributed_env(dep.config, node_rank=dep.ordinal, local_rank=local_rank,
                              pod_ips=dep.pod_ips, master_port=dep.master_port,
                              run_id=dep.launch_id, cpus_per_pod=dep.cpus or os.cpu_count())
        if "OMP_NUM_THREADS" in self.base_env:
            env.pop("OMP_NUM_THREADS", None)  # the user's own setting wins
        visible = self.base_env.get("CUDA_VISIBLE_DEVICES")
        procs = dep.config.procs(dep.ordinal)
        if visible and procs > 1:
            ids = [d for d in visible.split(",") if d]
            per = max(1, len(ids) // procs)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[local_rank * per:(local_rank + 1) * per])
        if dep.engine is not None:
            env.update(ENGINE_KINDS[dep.engine["kind"]].rank_env(dep.engine))
        env["KTLITE_POD_NAME"] = self.name
        env["KTLITE_LAUNCH_ID"] = dep.launch_id
        env["KTLITE_POD_IPS_FILE"] = self.pod_ips_file
        return env

    def _publish_pod_ips(self, dep: Deployment) -> None:
        tmp = self.pod_ips_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pod_ips": dep.pod_ips, "launch_id": dep.launch_id}, f)
        os.replace(tmp, self.pod_ips_file)

    def _log(self, rank: RankProcess, stream: str, line: str) -> None:
        # the pod's own log keeps every rank line (``remote.logs()``, ``kubectl logs``)
        print(f"[rank {rank.global_rank}] {line}", file=sys.stderr, flush=True)
        # a rank running several calls at once: its lines go to each of them
        for sink in list(self._sinks.get(rank.local_rank, {}).values()):
            sink(rank.global_rank, stream, line)

    async def prespawn(self) -> None:
        """Start rank processes before any code arrives, so the first deploy is fast."""
        await asyncio.gather(*(self._spawn(i) for i in range(self._prespawn)), return_exceptions=True)

    async def _spawn(self, local_rank: int) -> RankProcess:
        rank = RankProcess(local_rank, self.base_env, self._log)
        while len(self.ranks) <= local_rank:
            self.ranks.append(None)  # type: ignore[arg-type]
        old = self.ranks[local_rank]
        if old is not None:
            rank.restarts, rank.streak = old.restarts, old.streak
            rank.last_exit = old.exit_code if old.exit_code is not None else old.last_exit
            old.kill()
        self.ranks[local_rank] = rank
        await rank.start()
        return rank

    async def _load(self, rank: RankProcess, dep: Deployment) -> Outcome:
        env = self.rank_env(dep, rank.local_rank)
        rank.global_rank = dep.config.first_rank(dep.ordinal) + rank.local_rank
        msg = {"env": env, "bundle": dep.bundle, "kind": dep.kind, "init": dep.init, "sources": dep.sources,
               "concurrency": dep.concurrency}
        try:
            ok, info = await rank.load(msg, dep.load_timeout)
        except RankGone as e:
            return Outcome(rank.global_rank, "died", message=f"while loading the code: {e}")
        if not ok:
            from ktlite import protocol
            return Outcome(rank.global_rank, "error", protocol.dumps(info))
        # a process that lacks a colocated target (a new or restarted one) loads it; one that
        # kept its instances through a reload of the primary code keeps them
        for name, target in list(self.colocated.items()):
            if name not in rank.targets:
                out = await self._load_target(rank, dep, name, target)
                if out.status != "ok":
                    return out
        return Outcome(rank.global_rank, "ok")

    async def _load_target(self, rank: RankProcess, dep: Deployment, name: str,
                           target: Colocated | None) -> Outcome:
        """Load (or with ``target`` None, drop) one colocated target in one rank process."""
        msg: dict[str, Any] = {"env": self.rank_env(dep, rank.local_rank), "target": name}
        if target is None:
            msg["drop"] = True
        else:
            msg.update(bundle=target.bundle, kind=target.kind, init=target.init, sources=target.sources)
        try:
            ok, info = await rank.load(msg, dep.load_timeout)
        except RankGone as e:
            return Outcome(rank.global_rank, "died", message=f"while loading colocated {name!r}: {e}")
        if ok:
            if target is None:
                rank.targets.discard(name)
            else:
                rank.targets.add(name)
            return Outcome(rank.global_rank, "ok")
        rank.targets.discard(name)
        from ktlite import protocol
        return Outcome(rank.global_rank, "error", protocol.dumps(info))

    async def colocate(self, name: str, target: Colocated | None, if_missing: bool = False) -> list[Outcome]:
        """Add/replace (``target`` given) or remove (None) a colocated target on every local
        rank; waits its turn behind running calls, like a call. ``if_missing``: only where a
        rank lacks it (re-pushed after a redeploy: instances that survived it stay)."""
        await self.gate.close()  # running calls end first, as for a deploy
        try:
            return await self._colocate(name, target, if_missing)
        finally:
            self.gate.open(self.dep.concurrency if self.dep is not None else 1)

    async def _colocate(self, name: str, target: Colocated | None, if_missing: bool) -> list[Outcome]:
        async with self.lock:
            await self._settle()
            dep = self.dep
            if dep is None:
                raise RuntimeError(f"pod {self.name} has no code deployed to colocate {name!r} with")
            if if_missing and target is not None and self.colocated.get(name) == target:
                bad = await self._heal()  # a restarted rank loads every target
                return bad or [Outcome(r.global_rank, "ok") for r in self.ranks if r is not None]
            if target is None:
                self.colocated.pop(name, None)
            else:
                self.colocated[name] = target
            bad = await self._heal()  # a restarted rank loads every target, this one included
            if not bad:
                bad = outs = list(await asyncio.gather(*(self._load_target(r, dep, name, target)
                                                         for r in self.ranks if r is not None)))
                if all(o.status == "ok" for o in outs):
                    return outs
            if target is not None:
                # a target that failed to load stays nowhere: a rank restart must not trip on it
                self.colocated.pop(name, None)
                await asyncio.gather(*(self._load_target(r, dep, name, None) for r in self.ranks
                                       if r is not None and r.alive and name in r.targets))
            return bad

    async def _ready_rank(self, local_rank: int, dep: Deployment, restart: bool) -> Outcome:
        rank = self.ranks[local_rank] if local_rank < len(self.ranks) else None
        env = self.rank_env(dep, local_rank)
        fresh = rank is not None and rank.alive and rank.loaded_env is None
        same = rank is not None and rank.loaded_env is not None and _layout(rank.loaded_env) == _layout(env)
        if rank is None or not rank.alive or restart or not (fresh or same):
            try:
                rank = await self._spawn(local_rank)
            except Exception as e:  # noqa: BLE001
                return Outcome(dep.config.first_rank(dep.ordinal) + local_rank, "died",
                               message=f"rank process failed to start: {e}")
        return await self._load(rank, dep)

    async def deploy(self, dep: Deployment, restart: bool = False) -> list[Outcome]:
        # running calls end first (before the lock: an admitted call takes it briefly to
        # start), and new ones wait for the new code
        await self.gate.close()
        self.ready_launch = None
        try:
            async with self.lock:
                outs = await self._deploy(dep, restart)
            if all(o.status == "ok" for o in outs):
                self.ready_launch = dep.launch_id
            return outs
        finally:
            self.gate.open(dep.concurrency)

    async def _deploy(self, dep: Deployment, restart: bool) -> list[Outcome]:
        await self._settle()
        # an engine's other pods run the engine alone: the call (Ray's driver, Monarch's
        # controller) is pod 0's, and a class there is built once, not once per pod
        want = 0 if dep.engine is not None and dep.ordinal > 0 else dep.config.procs(dep.ordinal)
        self.engine_failed = None
        try:
            await self._ensure_engine(dep)
        except EngineError as e:
            # peers waiting for this pod's engine learn it from /health; a pod without ranks reports it too
            self.engine_failed = {"launch_id": dep.launch_id, "message": str(e)[:2000]}
            return [Outcome(dep.config.first_rank(dep.ordinal) + i, "died", message=str(e)) for i in range(max(want, 1))]
        self.dep = dep
        self._publish_pod_ips(dep)
        for extra in self.ranks[want:]:
            if extra is not None:
                extra.kill()
        del self.ranks[want:]
        if restart:
            for r in self.ranks:
                if r is not None:
                    r.restarts = r.streak = 0
        return list(await asyncio.gather(*(self._ready_rank(i, dep, restart) for i in range(want))))

    async def _ensure_engine(self, dep: Deployment) -> None:
        """Start, keep or stop this pod's engine for ``dep``; pod 0 then waits until every
        pod's engine has joined (bounded by the load timeout)."""
        cfg = dep.engine
        if self.engine is not None and (cfg != self.engine.cfg or not self.engine.alive):
            old, self.engine = self.engine, None
            await old.stop()
        if cfg is None:
            return
        deadline = time.monotonic() + dep.load_timeout
        if self.engine is None:
            kind = cfg["kind"]
            engine = ENGINE_KINDS[kind](cfg, self.name, lambda line: print(f"[{kind}] {line}", file=sys.stderr,
                                        flush=True), launch_id=dep.launch_id, peers=self.peers)
            await engine.start(dep.load_timeout)
            self.engine = engine
        self.engine.launch_id = dep.launch_id  # a kept engine serves this launch (peers' failures name it)
        await self.engine.await_cluster(max(1.0, deadline - time.monotonic()))

    async def engine_status(self) -> dict[str, Any] | None:
        """This pod's engine, and on pod 0 the cluster's members with the lost ones named."""
        return None if self.engine is None else await self.engine.cluster_status()

    def _needs_heal(self, r: RankProcess | None) -> bool:
        return r is not None and (r.stopping or not r.alive)

    async def _heal(self) -> list[Outcome]:
        """Replace rank processes that died or that we killed; one heal at a time.

        Only a death between calls (an idle rank that crashed or was killed) counts against
        max_restarts: a death during a call is that call's error, reported to its caller, and
        the next call gets a fresh process. A rank beyond the budget is reported, not restarted.
        """
        if not any(self._needs_heal(r) for r in self.ranks) and not self._heal_lock.locked():
            return []  # the usual case before a call: nothing to replace
        async with self._heal_lock:
            dep = self.dep
            if dep is None:
                return []
            victims = [r for r in self.ranks if self._needs_heal(r)]
            await asyncio.gather(*(r.wait_dead(5.0) for r in victims))
            broken: list[Outcome] = []
            todo: list[tuple[int, bool, bool]] = []
            for r in victims:
                crashed = not r.stopping
                charged = crashed and not r.died_in_call
                if charged and r.has_pg:
                    # it died between calls holding a process group: its peers still hold theirs
                    self.lost_groups[r.global_rank] = r.death_message()
                if charged and r.streak >= dep.max_restarts:
                    broken.append(Outcome(r.global_rank, "died", message=(
                        f"rank process died {r.streak + 1} times; max_restarts={dep.max_restarts} "
                        f"reached (last: {r.death_message()}); call with restart_procs=True or redeploy")))
                    continue
                todo.append((r.local_rank, crashed, charged))
            outs = await asyncio.gather(*(self._ready_rank(i, dep, restart=True) for i, _, _ in todo))
            for (i, crashed, charged), out in zip(todo, outs, strict=True):
                if out.status == "ok":
                    self.restarted.append(self.ranks[i].global_rank)
                if crashed:
                    self.ranks[i].restarts += 1
                if charged:
                    self.ranks[i].streak += 1
            return broken + [o for o in outs if o.status != "ok"]

    def _heal_later(self) -> None:
        """Heal in the background so the next call finds the pod ready; never two at once."""
        if self._healing is not None and not self._healing.done():
            return  # the running heal loops until no rank needs it

        async def heal() -> None:
            while any(self._needs_heal(r) for r in self.ranks) and self.dep is not None:
                broken = await self._heal()
                if broken:
                    return  # reported to the next call
        self._healing = asyncio.get_running_loop().create_task(heal())

    async def _settle(self) -> None:
        if self._healing is not None:
            await self._healing
            self._healing = None

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
        self.group_port = next((base + (last + k) % PORT_SPAN for k in range(1, PORT_SPAN)
                                if port_free(base + (last + k) % PORT_SPAN)), base + self.generation % PORT_SPAN)

    # ---- calls -------------------------------------------------------------------------

    async def run(self, call_id: str, payload: Any, path: str | None, emit: LogEmit | None,
                  restart: bool = False, per_rank: dict[str, Any] | None = None,
                  generation: int = 0, ranks: list[int] | None = None,
                  group_port: int | None = None) -> list[Outcome]:
        """Run one call on every local rank; ``path`` names a shared-memory copy of ``payload``;
        ``generation`` and ``group_port`` name the process group its collectives use (pod 0's
        choice: see :meth:`next_generation`)."""
        if call_id in self.finished:
            return self.finished[call_id]  # duplicate delivery runs once
        if call_id in self.calls:
            handle = self.calls[call_id]
            await handle.done.wait()
            return handle.outcomes
        handle = _CallHandle(call_id)
        early = self.cancelled_early.pop(call_id, None)
        if early is not None:  # the stop overtook the call on its way here: never start it
            handle.stop_kind, handle.stop_reason = early
        self.calls[call_id] = handle
        self.calls_total += 1
        try:
            handle.outcomes = await self._run(handle, payload, path, emit, restart, per_rank, generation, ranks,
                                              group_port)
        finally:
            self.calls.pop(call_id, None)
            handle.done.set()
            self.finished[call_id] = handle.outcomes
            while len(self.finished) > 256:
                self.finished.popitem(last=False)
        return handle.outcomes

    async def _run(self, handle: _CallHandle, payload: Any, path: str | None, emit: LogEmit | None,
                   restart: bool, per_rank: dict[str, Any] | None = None, generation: int = 0,
                   ranks: list[int] | None = None, group_port: int | None = None) -> list[Outcome]:
        await self.gate.acquire()  # FIFO: at most the deployment's concurrency run at once
        try:
            return await self._admitted(handle, payload, path, emit, restart, per_rank, generation, ranks,
                                        group_port)
        finally:
            self.gate.release()

    async def _admitted(self, handle: _CallHandle, payload: Any, path: str | None, emit: LogEmit | None,
                        restart: bool, per_rank: dict[str, Any] | None, generation: int,
                        ranks: list[int] | None = None, group_port: int | None = None) -> list[Outcome]:
        async with self.lock:  # heals and restarts happen between calls, never under one
            await self._settle()
            dep = self.dep
            if dep is None:
                raise RuntimeError("no code deployed on this pod; call .to() first")
            if restart:  # fresh processes, and a fresh max_restarts budget
                for r in self.ranks:
                    if r is not None:
                        r.restarts = r.streak = 0
                loads = await asyncio.gather(*(self._ready_rank(i, dep, True) for i in range(len(self.ranks))))
                bad = [o for o in loads if o.status != "ok"]
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
                return [Outcome(first + i, "died", message=(
                    f"rank {first + i} died between calls ({lost[first + i]}) and was restarted; the "
                    "deployment's process group is formed anew at the next call: call again"))
                        if first + i in lost else
                        Outcome(first + i, "cancelled", message="not started: a rank of this pod was restarted")
                        for i in range(dep.config.procs(dep.ordinal))]
            if handle.stop_kind:  # cancelled before it started, or while ranks were restarted
                # the ranks keep their groups: pod 0 moves the deployment to a new
                # process-group generation after a stopped call (see Rank.regroup)
                if any(self._needs_heal(r) for r in self.ranks):
                    self._heal_later()
                first = dep.config.first_rank(dep.ordinal)
                return [Outcome(first + i, handle.stop_kind, message=handle.stop_reason)
                        for i in range(dep.config.procs(dep.ordinal)) if ranks is None or first + i in ranks]
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
                items = {i: bytes(view[off:off + n]) for i, (off, n) in enumerate(slices)}
            view = view[:per_rank["shared"]]
            if LOG_BODIES:
                logger.info("call %s: shared message %d bytes; per-rank items %s", handle.call_id, view.nbytes, ", ".join(f"rank {first + i}: {n} bytes" for i, (_, n) in enumerate(slices)))
        elif LOG_BODIES:
            logger.info("call %s: message %d bytes", handle.call_id, view.nbytes)
        size = view.nbytes
        msg: dict[str, Any] = {"id": handle.call_id, "args": None if path else bytes(view), "path": path,
                               "size": size, "items": items, "item_at": item_at, "generation": generation,
                               "group_port": group_port}
        if emit is not None:
            for r in self.ranks:
                self._sinks.setdefault(r.local_rank, {})[handle.call_id] = emit
        try:
            return await self._fan_in(handle, msg, None if ranks is None else set(ranks))
        finally:
            for sinks in self._sinks.values():
                sinks.pop(handle.call_id, None)
            if own_file and path:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    async def _fan_in(self, handle: _CallHandle, msg: dict[str, Any], only: set[int] | None = None) -> list[Outcome]:
        now = time.monotonic()
        tasks = {}
        for r in self.ranks:
            if only is not None and r.global_rank not in only:
                continue  # the call names other ranks
            r.busy_since = r.busy_since or now
            tasks[asyncio.get_running_loop().create_task(self._call_rank(handle, r, msg))] = r
        outcomes: dict[int, Outcome] = {}
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                o = t.result()
                outcomes[o.rank] = o
                if not tasks[t].running:
                    tasks[t].busy_since = None
                if o.status != "ok" and not handle.stop_kind:
                    handle.stop_kind = "cancelled"
                    handle.stop_reason = f"stopped because rank {o.rank} failed"
                    for other in pending:
                        self._stop_rank(tasks[other], handle.call_id)
        if any(self._needs_heal(r) for r in self.ranks):
            self._heal_later()
        return [outcomes[k] for k in sorted(outcomes)]

    async def _call_rank(self, handle: _CallHandle, rank: RankProcess, msg: dict[str, Any]) -> Outcome:
        rank.running[handle.call_id] = time.monotonic()
        items, item_at = msg.get("items"), msg.get("item_at")
        msg = {k: v for k, v in msg.items() if k not in ("items", "item_at")}
        if items is not None:
            msg["item"] = items[rank.local_rank]
        elif item_at is not None:
            msg["item_at"] = item_at[rank.local_rank]
        try:
            _, _, ok, inline, path, size = await rank.call(msg)
        except RankGone as e:
            # we stopped it (SIGKILL); a rank that exited by itself, even while we were
            # stopping it, keeps its own exit code and is reported as a death. A rank that
            # ran other calls too fails each of them with its death.
            if handle.stop_kind and rank.stopping and rank.exit_code in (None, -signal.SIGKILL):
                return Outcome(rank.global_rank, handle.stop_kind, message=handle.stop_reason)
            rank.died_in_call = True
            return Outcome(rank.global_rank, "died", message=str(e))
        finally:
            rank.running.pop(handle.call_id, None)
        if rank.tainted:  # stopped inside an import: replaced before its next call
            rank.kill()
        if not ok and handle.stop_kind:  # interrupted on its own (CallInterrupted): the stop's outcome
            return Outcome(rank.global_rank, handle.stop_kind, message=handle.stop_reason)
        return Outcome(rank.global_rank, "ok" if ok else "error", inline, path=path, size=size)

    def _stop_rank(self, rank: RankProcess, call_id: str) -> None:
        """Stop one call on one rank and keep the process (and its state): the call is
        interrupted (CallInterrupted raised in it: SIGUSR2 on the main thread, an async
        exception on a pool thread, a cancelled coroutine), and only if it has not ended
        within INTERRUPT_GRACE_S (blocked in C code, in a collective) the rank is killed."""
        async def interrupt() -> None:
            if self.dep is not None and self.dep.concurrency > 1:
                await rank.interrupt(call_id)
            else:
                rank.interrupt_main()
            deadline = time.monotonic() + INTERRUPT_GRACE_S
            while call_id in rank.running and rank.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if call_id in rank.running and rank.alive:
                logger.warning("call %s ignored its interrupt for %gs: killing rank %d and the calls it ran", call_id, INTERRUPT_GRACE_S, rank.global_rank)
                rank.kill()
        asyncio.get_running_loop().create_task(interrupt())

    def reset(self) -> None:
        """A call failed elsewhere: restart this pod's dead ranks, if any, in the background."""
        if any(self._needs_heal(r) for r in self.ranks):
            self._heal_later()

    async def restart_failed(self) -> dict[str, Any]:
        """Restart the rank processes that died (only those); which ranks were restarted
        since the last time this was asked (by the background heal or now), and which
        could not be."""
        async with self.lock:
            await self._settle()
            broken = await self._heal()
        restarted, self.restarted = sorted(set(self.restarted)), []
        return {"pod": self.name, "restarted": restarted,
                "failed": [{"rank": o.rank, "status": o.status, "message": o.message} for o in broken]}

    def cancel(self, call_id: str, kind: str = "cancelled", reason: str = "cancelled") -> bool:
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
                self._stop_rank(r, call_id)
        return True

    async def status(self, stuck_after: float = DEFAULT_STUCK_AFTER_S) -> dict[str, Any]:
        """Each rank's state and what it uses; ``stuck`` marks a rank busy with one call for
        longer than ``stuck_after`` seconds (a hang in a collective, a deadlock: NeMo RL's
        stuck-worker check).

        Per rank: ``pid``, ``cpu_percent`` / ``rss_bytes`` / ``procs`` (the rank process and
        everything it started), ``calls`` (each running call's ``id`` and ``running_s``), and
        where this pod has ``nvidia-smi``: the rank's GPUs (its ``CUDA_VISIBLE_DEVICES``) with
        memory used/total and utilisation. Fields that cannot be known are None.
        """
        ranks = [r for r in self.ranks if r is not None]
        live = [r.pid for r in ranks if r.alive and r.pid is not None]
        usage, (gpus, apps, gpu_error) = await asyncio.gather(self.usage.measure(live),
                                                              self.gpu_query.snapshot())
        now = time.monotonic()
        server_cvd = self.base_env.get("CUDA_VISIBLE_DEVICES")
        rows = []
        for r in ranks:
            used = usage.get(r.pid) if r.alive and r.pid is not None else None
            row = {
                "rank": r.global_rank, "local_rank": r.local_rank, "pid": r.pid,
                "state": "busy" if r.alive and r.busy_since else ("idle" if r.alive else "dead"),
                "busy_for_s": round(now - r.busy_since, 3) if r.busy_since else None,
                "stuck": bool(r.alive and r.busy_since and now - r.busy_since > stuck_after),
                "last_exit": r.exit_code if r.exit_code is not None else r.last_exit,
                "restarts": r.restarts,
                "calls": [{"id": cid, "running_s": round(now - t, 3)}
                          for cid, t in sorted(r.running.items(), key=lambda kv: kv[1])],
                "cpu_percent": used["cpu_percent"] if used else None,
                "rss_bytes": used["rss_bytes"] if used else None,
                "procs": used["procs"] if used else None,
                "targets": sorted(r.targets),
            }
            row.update(self._gpu_fields(r, gpus, apps, server_cvd))
            rows.append(row)
        return {
            "pod": self.name, "ordinal": self.ordinal, "server_pid": os.getpid(),
            "kind": self.dep.kind if self.dep else None,
            "launch_id": self.dep.launch_id if self.dep else None,
            # how the caller laid it out: what reattaching by name (kt.fn(name=...)) needs
            "layout": {"distributed": asdict(self.dep.config), "single": self.dep.single}
            if self.dep else None,
            "colocated": sorted(self.colocated),
            "ranks": rows,
            "active_calls": list(self.calls),
            "gpus": None if gpus is None else visible(gpus, server_cvd),
            "gpu_error": gpu_error,
            "engine": await self.engine_status(),
        }

    def _gpu_fields(self, r: RankProcess, gpus: list[dict[str, Any]] | None, apps: Apps | None,
                    server_cvd: str | None) -> dict[str, Any]:
        """The GPUs rank ``r`` sees (its CUDA_VISIBLE_DEVICES, else the server's), their memory
        and utilisation, and what the rank's own processes hold on them."""
        if gpus is None:  # no nvidia-smi on this pod
            return dict(gpus=None, gpu_memory_used_bytes=None, gpu_memory_total_bytes=None,
                        gpu_utilization_percent=None, gpu_process_memory_bytes=None)
        env = r.loaded_env if r.loaded_env is not None else r.env
        pids = set(self.usage.tree_pids(r.pid)) if r.alive and r.pid is not None else set()
        return rank_gpu_summary(visible(gpus, env.get("CUDA_VISIBLE_DEVICES", server_cvd)), apps, pids)

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
        for r in self.ranks:
            if r is not None:
                r.kill()
        await asyncio.gather(*(r.wait_dead(2) for r in self.ranks if r is not None))
        with contextlib.suppress(OSError):
            os.unlink(self.pod_ips_file)

