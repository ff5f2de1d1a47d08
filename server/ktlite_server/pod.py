"""One pod's runtime: its rank processes, the loaded deployment, and the calls it runs.

A call on a pod runs on all its local ranks at once (up to the deployment's concurrency of
calls, admitted in order: :mod:`ktlite_server.podcalls`). When one rank fails, its siblings in
the call are interrupted and keep their processes and state; one still running after
INTERRUPT_GRACE_S (blocked in a collective) is killed. Only dead ranks are restarted, so the
next call finds a healthy pod.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import logging
import os
import shutil
import sys
import time
from typing import Any

from ktlite_server import rankpreload
from ktlite_server.callhistory import CallHistory
from ktlite_server.deployment import Colocated, Deployment, layout_of
from ktlite_server.engine import Engine, EngineError
from ktlite_server.gate import Gate
from ktlite_server.keptoutcomes import Kept
from ktlite_server.localcall import CallHandle
from ktlite_server.metrics import CallMetrics
from ktlite_server.monarchhost import MonarchHost
from ktlite_server.peers import PeerPool
from ktlite_server.podcalls import LogEmit, PodCalls
from ktlite_server.podstatus import pod_status
from ktlite_server.ranks import Outcome, RankGone, RankProcess
from ktlite_server.raynode import RayNode
from ktlite_server.usage import GpuQuery, ProcessUsage
from ktlite_wire import privatefiles, rankchannel
from ktlite_wire.distenv import distributed_env
from ktlite_wire.status import Status

logger = logging.getLogger(__name__)
_RESERVED = ("KTLITE_TOKEN",)


DEFAULT_STUCK_AFTER_S = 600.0  # a rank busy with one call longer than this is reported stuck


ENGINE_KINDS: dict[str, type[Engine]] = {"ray": RayNode, "monarch": MonarchHost}


class Pod(PodCalls):
    # what a rank is: a child process (bench/bench_scale.py runs an in-process stand-in of
    # the same contract, to hold a thousand simulated pods on one machine)
    rank_type: type[RankProcess] = RankProcess

    def __init__(self, name: str, ordinal: int, procs: int = 1) -> None:
        self.name = name
        self.ordinal = ordinal
        self.base_env = {k: v for k, v in os.environ.items() if k not in _RESERVED}
        self.ranks: list[RankProcess] = []
        self.dep: Deployment | None = None
        self.ready_launch: str | None = None  # the launch every rank loaded (readiness)
        self.heap_frozen = False  # the first launch's objects were frozen (gc.freeze)
        # colocated targets by name: kept across redeploys of the primary code, loaded into
        # every rank process this pod starts (a restarted rank gets them all back)
        self.colocated: dict[str, Colocated] = {}
        self.lock = asyncio.Lock()
        self.gate = Gate(1)  # calls at once on this pod (the deployment's concurrency)
        self.order = asyncio.Lock()  # pod 0: a distributed deployment's calls, one at a time, FIFO
        self.generation = 0  # pod 0: the process-group generation (bumped after a failed call)
        # pod 0: that generation's MASTER_PORT (None: the deployment's)
        self.group_port: int | None = None
        self.restarted: list[int] = []  # ranks restarted since restart_failed() last asked
        self.lost_groups: dict[int, str] = {}  # ranks that died idle holding a process group
        self.last_generation = 0  # the process-group generation of the last call run here
        self.calls: dict[str, CallHandle] = {}
        self.calls_total = 0
        self.call_metrics = CallMetrics()  # what GET /metrics reports
        self.history = CallHistory()  # the recent calls GET /status reports
        self.finished: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self.cancelled_early: collections.OrderedDict[str, tuple[Status, str]] = (
            collections.OrderedDict()
        )
        self._sinks: dict[int, dict[str, LogEmit]] = {}  # local rank -> call id -> its log stream
        self._prespawn = procs
        self.torch_seen = False  # a rank of this deployment used torch (rankpreload)
        self._healing: asyncio.Task[None] | None = None
        self._heal_lock = asyncio.Lock()
        self.engine: Engine | None = None  # distribute("ray"/"monarch"): this pod's engine
        # this pod's connections to the others (the server gives it the token)
        self.peers = PeerPool()
        self.last_active = time.monotonic()  # the last authorized request (--inactivity-ttl)
        self.inactivity_ttl: float | None = None  # seconds, reported by /health with idle_s
        self.engine_failed: dict[str, str] | None = None  # {"launch_id", "message"} (in /health)
        self.usage = ProcessUsage()
        self.gpu_query = GpuQuery()
        # the deployment's pod addresses, rewritten at every deploy: ktlite.distributed.pod_ips()
        # (in a directory of this pod's own, 0700 under an unpredictable name: nothing another
        # user planted at a predictable path is written through; the store address joins it)
        self.files_dir = privatefiles.scratch_dir("ktlite-pod-")
        self.pod_ips_file = os.path.join(self.files_dir, "ktlite-pod-ips.json")

    def rank_env(self, dep: Deployment, local_rank: int) -> dict[str, str]:
        env = distributed_env(
            dep.config,
            node_rank=dep.ordinal,
            local_rank=local_rank,
            pod_ips=dep.pod_ips,
            master_port=dep.master_port,
            run_id=dep.launch_id,
            cpus_per_pod=dep.cpus or os.cpu_count(),
        )
        if "OMP_NUM_THREADS" in self.base_env:
            env.pop("OMP_NUM_THREADS", None)  # the user's own setting wins
        visible = self.base_env.get("CUDA_VISIBLE_DEVICES")
        procs = dep.config.procs(dep.ordinal)
        if visible and procs > 1:
            ids = [d for d in visible.split(",") if d]
            per = max(1, len(ids) // procs)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[local_rank * per : (local_rank + 1) * per])
        if dep.engine is not None:
            env.update(ENGINE_KINDS[dep.engine["kind"]].rank_env(dep.engine))
        env["KTLITE_POD_NAME"] = self.name
        env["KTLITE_LAUNCH_ID"] = dep.launch_id
        env["KTLITE_POD_IPS_FILE"] = self.pod_ips_file
        return env

    def _publish_pod_ips(self, dep: Deployment) -> None:
        privatefiles.write_file(
            self.pod_ips_file, json.dumps({"pod_ips": dep.pod_ips, "launch_id": dep.launch_id})
        )

    def _log(self, rank: RankProcess, stream: str, line: str) -> None:
        # the pod's own log keeps every rank line (``remote.logs()``, ``kubectl logs``)
        print(f"[rank {rank.global_rank}] {line}", file=sys.stderr, flush=True)
        # a rank running several calls at once: its lines go to each of them
        for sink in list(self._sinks.get(rank.local_rank, {}).values()):
            sink(rank.global_rank, stream, line)

    async def prespawn(self) -> None:
        """Start rank processes before any code arrives, so the first deploy is fast."""
        await asyncio.gather(
            *(self._spawn(i) for i in range(self._prespawn)), return_exceptions=True
        )

    def _start_env(self) -> dict[str, str]:
        """A rank's first environment (its zygote's): the pod's, and once the deployment's
        ranks used torch, the preload that makes a restart cheap (``rankpreload``)."""
        rank_env = self.rank_env(self.dep, 0) if self.dep is not None else None
        return rankpreload.start_env(self.base_env, rank_env, self.torch_seen)

    async def _spawn(self, local_rank: int) -> RankProcess:
        while len(self.ranks) <= local_rank:
            self.ranks.append(None)  # type: ignore[arg-type]
        old = self.ranks[local_rank]
        # a rank replaced where this deployment's ranks used torch is forked with it imported
        self.torch_seen = self.torch_seen or rankpreload.used_torch([old])
        rank = self.rank_type(local_rank, self._start_env(), self._log)
        rank.alone = (self.dep.config.procs(self.ordinal) if self.dep else self._prespawn) <= 1
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
        msg = rankchannel.Load(
            env=env,
            kind=dep.kind,
            bundle=dep.bundle,
            init=dep.init,
            sources=dep.sources,
            concurrency=dep.concurrency,
        )
        try:
            loaded = await rank.load(msg, dep.load_timeout)
        except RankGone as e:
            return Outcome(rank.global_rank, Status.DIED, message=f"while loading the code: {e}")
        if not loaded.ok:
            return Outcome(rank.global_rank, Status.ERROR, loaded.error)
        self.torch_seen = self.torch_seen or rankpreload.used_torch([rank])  # its code did
        # a process that lacks a colocated target (a new or restarted one) loads it; one that
        # kept its instances through a reload of the primary code keeps them
        for name, target in list(self.colocated.items()):
            if name not in rank.targets:
                out = await self._load_target(rank, dep, name, target)
                if out.status is not Status.OK:
                    return out
        return Outcome(rank.global_rank, Status.OK)

    async def _load_target(
        self, rank: RankProcess, dep: Deployment, name: str, target: Colocated | None
    ) -> Outcome:
        """Load (or with ``target`` None, drop) one colocated target in one rank process."""
        env = self.rank_env(dep, rank.local_rank)
        msg = (
            rankchannel.Load(env=env, target=name, drop=True)
            if target is None
            else rankchannel.Load(
                env=env,
                target=name,
                kind=target.kind,
                bundle=target.bundle,
                init=target.init,
                sources=target.sources,
            )
        )
        try:
            loaded = await rank.load(msg, dep.load_timeout)
        except RankGone as e:
            return Outcome(
                rank.global_rank, Status.DIED, message=f"while loading colocated {name!r}: {e}"
            )
        if loaded.ok:
            if target is None:
                rank.targets.discard(name)
            else:
                rank.targets.add(name)
            return Outcome(rank.global_rank, Status.OK)
        rank.targets.discard(name)
        return Outcome(rank.global_rank, Status.ERROR, loaded.error)

    async def colocate(
        self, name: str, target: Colocated | None, if_missing: bool = False
    ) -> list[Outcome]:
        """Add/replace (``target`` given) or remove (None) a colocated target on every local
        rank; waits its turn behind running calls, like a call. ``if_missing``: only where a
        rank lacks it (re-pushed after a redeploy: instances that survived it stay)."""
        await self.gate.close()  # running calls end first, as for a deploy
        try:
            return await self._colocate(name, target, if_missing)
        finally:
            self.gate.open(self.dep.concurrency if self.dep is not None else 1)

    async def _colocate(
        self, name: str, target: Colocated | None, if_missing: bool
    ) -> list[Outcome]:
        async with self.lock:
            await self._settle()
            dep = self.dep
            if dep is None:
                raise RuntimeError(
                    f"pod {self.name} has no code deployed to colocate {name!r} with"
                )
            if if_missing and target is not None and self.colocated.get(name) == target:
                bad = await self._heal()  # a restarted rank loads every target
                return bad or [
                    Outcome(r.global_rank, Status.OK) for r in self.ranks if r is not None
                ]
            if target is None:
                self.colocated.pop(name, None)
            else:
                self.colocated[name] = target
            bad = await self._heal()  # a restarted rank loads every target, this one included
            if not bad:
                bad = outs = list(
                    await asyncio.gather(
                        *(
                            self._load_target(r, dep, name, target)
                            for r in self.ranks
                            if r is not None
                        )
                    )
                )
                if all(o.status is Status.OK for o in outs):
                    return outs
            if target is not None:
                # a target that failed to load stays nowhere: a rank restart must not trip on it
                self.colocated.pop(name, None)
                await asyncio.gather(
                    *(
                        self._load_target(r, dep, name, None)
                        for r in self.ranks
                        if r is not None and r.alive and name in r.targets
                    )
                )
            return bad

    async def _ready_rank(self, local_rank: int, dep: Deployment, restart: bool) -> Outcome:
        rank = self.ranks[local_rank] if local_rank < len(self.ranks) else None
        env = self.rank_env(dep, local_rank)
        fresh = rank is not None and rank.alive and rank.loaded_env is None
        same = (
            rank is not None
            and rank.loaded_env is not None
            and layout_of(rank.loaded_env) == layout_of(env)
        )
        if rank is None or not rank.alive or restart or not (fresh or same):
            try:
                rank = await self._spawn(local_rank)
            except Exception as e:  # noqa: BLE001
                return Outcome(
                    dep.config.first_rank(dep.ordinal) + local_rank,
                    Status.DIED,
                    message=f"rank process failed to start: {e}",
                )
        return await self._load(rank, dep)

    async def deploy(self, dep: Deployment, restart: bool = False) -> list[Outcome]:
        # running calls end first (before the lock: an admitted call takes it briefly to
        # start), and new ones wait for the new code
        await self.gate.close()
        self.ready_launch = None
        try:
            async with self.lock:
                outs = await self._deploy(dep, restart)
            if all(o.status is Status.OK for o in outs):
                self.ready_launch = dep.launch_id
                if not self.heap_frozen:
                    # the first launch's state (its rank processes' handles and streams) lives
                    # as long as the server: frozen, the full collections that the calls'
                    # survivors trigger do not walk it (a pause in a call's tail). Once only: a
                    # later launch's garbage is never pinned
                    self.heap_frozen = True
                    gc.freeze()
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
            return [
                Outcome(dep.config.first_rank(dep.ordinal) + i, Status.DIED, message=str(e))
                for i in range(max(want, 1))
            ]
        self.dep = dep
        self.torch_seen = False  # learned again from this deployment's ranks (_spawn)
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
            engine = ENGINE_KINDS[kind](
                cfg,
                self.name,
                lambda line: print(f"[{kind}] {line}", file=sys.stderr, flush=True),
                launch_id=dep.launch_id,
                peers=self.peers,
            )
            await engine.start(dep.load_timeout)
            self.engine = engine
        # a kept engine serves this launch (peers' failures name it)
        self.engine.launch_id = dep.launch_id
        await self.engine.await_cluster(max(1.0, deadline - time.monotonic()))

    async def engine_status(self) -> dict[str, Any] | None:
        """This pod's engine, and on pod 0 the cluster's members with the lost ones named."""
        return None if self.engine is None else await self.engine.cluster_status()

    def _needs_heal(self, r: RankProcess | None) -> bool:
        return r is not None and (r.stopping or not r.alive)

    def _any_needs_heal(self) -> bool:
        """Whether a rank needs :meth:`_heal` (asked before and after every call: a loop, not
        ``any`` over :meth:`_needs_heal`: two calls a rank fewer)."""
        for r in self.ranks:  # noqa: SIM110 - any() resumes a generator once per rank
            if r is not None and (r.stopping or not r.alive):
                return True
        return False

    def _idle_ranks(self) -> bool:
        """Whether a call may start now without :meth:`_settle` or :meth:`_heal` (no heal due,
        none under way): ``PodCalls.run_now``."""
        return self._healing is None and not self._heal_lock.locked() and not self._any_needs_heal()

    async def _heal(self) -> list[Outcome]:
        """Replace rank processes that died or that we killed; one heal at a time.

        Only a death between calls (an idle rank that crashed or was killed) counts against
        max_restarts: a death during a call is that call's error, reported to its caller, and
        the next call gets a fresh process. A rank beyond the budget is reported, not restarted.
        """
        if not self._any_needs_heal() and not self._heal_lock.locked():
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
                    broken.append(
                        Outcome(
                            r.global_rank,
                            Status.DIED,
                            message=(
                                f"rank process died {r.streak + 1} times; max_restarts={dep.max_restarts} "
                                f"reached (last: {r.death_message()}); call with restart_procs=True or redeploy"
                            ),
                        )
                    )
                    continue
                todo.append((r.local_rank, crashed, charged))
            self.torch_seen = self.torch_seen or rankpreload.used_torch(self.ranks)  # survivors
            outs = await asyncio.gather(
                *(self._ready_rank(i, dep, restart=True) for i, _, _ in todo)
            )
            for (i, crashed, charged), out in zip(todo, outs, strict=True):
                if out.status is Status.OK:
                    self.restarted.append(self.ranks[i].global_rank)
                if crashed:
                    self.ranks[i].restarts += 1
                if charged:
                    self.ranks[i].streak += 1
            return broken + [o for o in outs if o.status is not Status.OK]

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

    # ---- after calls -------------------------------------------------------------------

    def reset(self) -> None:
        """A call failed elsewhere: restart this pod's dead ranks, if any, in the background."""
        if self._any_needs_heal():
            self._heal_later()

    async def restart_failed(self) -> dict[str, Any]:
        """Restart the rank processes that died (only those); which ranks were restarted
        since the last time this was asked (by the background heal or now), and which
        could not be."""
        async with self.lock:
            await self._settle()
            broken = await self._heal()
        restarted, self.restarted = sorted(set(self.restarted)), []
        return {
            "pod": self.name,
            "restarted": restarted,
            "failed": [{"rank": o.rank, "status": o.status, "message": o.message} for o in broken],
        }

    async def status(self, stuck_after: float = DEFAULT_STUCK_AFTER_S) -> dict[str, Any]:
        """Each rank's state and what it uses (see :func:`ktlite_server.podstatus.pod_status`)."""
        return await pod_status(self, stuck_after)

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
        for r in self.ranks:
            if r is not None:
                r.kill()
        await asyncio.gather(*(r.wait_dead(2) for r in self.ranks if r is not None))
        shutil.rmtree(self.files_dir, ignore_errors=True)
