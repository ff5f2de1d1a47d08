"""One pod's runtime: its rank processes, the loaded deployment, and the calls it runs.

A call on a pod runs on all its local ranks at once. When one rank fails, its siblings are
SIGKILLed at once (they may be blocked in a collective the failed rank never joins) and
restarted in the background, so the next call finds a healthy pod.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ktlite import shm
from ktlite.spec import DistributedConfig, distributed_env
from ktlite_server.ranks import Outcome, RankGone, RankProcess

LogEmit = Callable[[int, str, str], None]  # (global rank, stream, line)
_RESERVED = ("KTLITE_TOKEN",)

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


class Pod:
    def __init__(self, name: str, ordinal: int, procs: int = 1) -> None:
        self.name = name
        self.ordinal = ordinal
        self.base_env = {k: v for k, v in os.environ.items() if k not in _RESERVED}
        self.ranks: list[RankProcess] = []
        self.dep: Deployment | None = None
        # colocated targets by name: kept across redeploys of the primary code, loaded into
        # every rank process this pod starts (a restarted rank gets them all back)
        self.colocated: dict[str, Colocated] = {}
        self.lock = asyncio.Lock()
        self.calls: dict[str, _CallHandle] = {}
        self.finished: collections.OrderedDict[str, list[Outcome]] = collections.OrderedDict()
        self.cancelled_early: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._sinks: dict[int, LogEmit] = {}
        self._prespawn = procs
        self._healing: asyncio.Task[None] | None = None
        self._heal_lock = asyncio.Lock()
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
        if visible and dep.config.num_proc > 1:
            ids = [d for d in visible.split(",") if d]
            per = max(1, len(ids) // dep.config.num_proc)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[local_rank * per:(local_rank + 1) * per])
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
        sink = self._sinks.get(rank.local_rank)
        if sink is not None:
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
        rank.global_rank = dep.ordinal * dep.config.num_proc + rank.local_rank
        msg = {"env": env, "bundle": dep.bundle, "kind": dep.kind, "init": dep.init, "sources": dep.sources}
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
                return Outcome(dep.ordinal * dep.config.num_proc + local_rank, "died",
                               message=f"rank process failed to start: {e}")
        return await self._load(rank, dep)

    async def deploy(self, dep: Deployment, restart: bool = False) -> list[Outcome]:
        async with self.lock:
            await self._settle()
            self.dep = dep
            self._publish_pod_ips(dep)
            want = dep.config.num_proc
            for extra in self.ranks[want:]:
                if extra is not None:
                    extra.kill()
            del self.ranks[want:]
            if restart:
                for r in self.ranks:
                    if r is not None:
                        r.restarts = r.streak = 0
            return list(await asyncio.gather(*(self._ready_rank(i, dep, restart) for i in range(want))))

    def _needs_heal(self, r: RankProcess | None) -> bool:
        return r is not None and (r.stopping or not r.alive)

    async def _heal(self) -> list[Outcome]:
        """Replace rank processes that died or that we killed; one heal at a time.

        Only a death between calls (an idle rank that crashed or was killed) counts against
        max_restarts: a death during a call is that call's error, reported to its caller, and
        the next call gets a fresh process. A rank beyond the budget is reported, not restarted.
        """
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
                if charged and r.streak >= dep.max_restarts:
                    broken.append(Outcome(r.global_rank, "died", message=(
                        f"rank process died {r.streak + 1} times; max_restarts={dep.max_restarts} "
                        f"reached (last: {r.death_message()}); call with restart_procs=True or redeploy")))
                    continue
                todo.append((r.local_rank, crashed, charged))
            outs = await asyncio.gather(*(self._ready_rank(i, dep, restart=True) for i, _, _ in todo))
            for i, crashed, charged in todo:
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

    # ---- calls -------------------------------------------------------------------------

    async def run(self, call_id: str, payload: Any, path: str | None, emit: LogEmit | None,
                  restart: bool = False) -> list[Outcome]:
        """Run one call on every local rank; ``path`` names a shared-memory copy of ``payload``."""
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
        try:
            handle.outcomes = await self._run(handle, payload, path, emit, restart)
        finally:
            self.calls.pop(call_id, None)
            handle.done.set()
            self.finished[call_id] = handle.outcomes
            while len(self.finished) > 256:
                self.finished.popitem(last=False)
        return handle.outcomes

    async def _run(self, handle: _CallHandle, payload: Any, path: str | None, emit: LogEmit | None,
                   restart: bool) -> list[Outcome]:
        async with self.lock:
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
            if handle.stop_kind:  # cancelled before it started, or while ranks were restarted
                # the cancel found this call, so it reset nothing; other pods may have killed
                # ranks mid-collective, and a group kept here still names those dead processes
                self._kill_groups()
                if any(self._needs_heal(r) for r in self.ranks):
                    self._heal_later()
                return [Outcome(dep.ordinal * dep.config.num_proc + i, handle.stop_kind,
                                message=handle.stop_reason) for i in range(dep.config.num_proc)]
            size = memoryview(payload).nbytes
            own_file = path is None and size > shm.INLINE_MAX
            if own_file:
                path, size = shm.write([payload], shm.ARG_PREFIX)
            msg = {"id": handle.call_id, "args": None if path else bytes(payload), "path": path, "size": size}
            if emit is not None:
                for r in self.ranks:
                    self._sinks[r.local_rank] = emit
            try:
                return await self._fan_in(handle, msg)
            finally:
                self._sinks.clear()
                if own_file and path:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    async def _fan_in(self, handle: _CallHandle, msg: dict[str, Any]) -> list[Outcome]:
        now = time.monotonic()
        tasks = {}
        for r in self.ranks:
            r.busy_since = now
            tasks[asyncio.get_running_loop().create_task(self._call_rank(handle, r, msg))] = r
        outcomes: dict[int, Outcome] = {}
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                o = t.result()
                outcomes[o.rank] = o
                tasks[t].busy_since = None
                if o.status != "ok" and not handle.stop_kind:
                    handle.stop_kind = "cancelled"
                    handle.stop_reason = f"stopped because rank {o.rank} failed"
                    for other in pending:
                        tasks[other].kill()
        if handle.stop_kind:
            self._kill_groups()
        if any(self._needs_heal(r) for r in self.ranks):
            self._heal_later()
        return [outcomes[k] for k in sorted(outcomes)]

    async def _call_rank(self, handle: _CallHandle, rank: RankProcess, msg: dict[str, Any]) -> Outcome:
        try:
            _, _, ok, inline, path, size = await rank.call(msg)
        except RankGone as e:
            # we stopped it (SIGKILL); a rank that exited by itself, even while we were
            # stopping it, keeps its own exit code and is reported as a death
            if handle.stop_kind and rank.stopping and rank.exit_code in (None, -signal.SIGKILL):
                return Outcome(rank.global_rank, handle.stop_kind, message=handle.stop_reason)
            rank.died_in_call = True
            return Outcome(rank.global_rank, "died", message=str(e))
        return Outcome(rank.global_rank, "ok" if ok else "error", inline, path=path, size=size)

    def _kill_groups(self) -> None:
        """Kill idle ranks holding a torch process group: after a failed call their peers
        are new processes, and a kept group would wait for the dead ones forever."""
        for r in self.ranks:
            if r is not None and r.alive and not r.stopping and r.has_pg and r.busy_since is None:
                r.kill()

    def reset(self) -> None:
        """A call failed elsewhere: drop this pod's process groups (restarting those ranks)."""
        if self.calls:
            return  # the running call is being cancelled and resets when it ends
        self._kill_groups()
        if any(self._needs_heal(r) for r in self.ranks):
            self._heal_later()

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
            if r is not None and r.busy_since is not None:
                r.kill()
        return True

    def status(self, stuck_after: float = DEFAULT_STUCK_AFTER_S) -> dict[str, Any]:
        """Each rank's state; ``stuck`` marks a rank busy with one call for longer than
        ``stuck_after`` seconds (a hang in a collective, a deadlock: NeMo RL's stuck-worker check)."""
        now = time.monotonic()
        return {
            "pod": self.name, "ordinal": self.ordinal, "server_pid": os.getpid(),
            "kind": self.dep.kind if self.dep else None,
            "launch_id": self.dep.launch_id if self.dep else None,
            "colocated": sorted(self.colocated),
            "ranks": [{
                "rank": r.global_rank, "local_rank": r.local_rank, "pid": r.pid,
                "state": "busy" if r.alive and r.busy_since else ("idle" if r.alive else "dead"),
                "busy_for_s": round(now - r.busy_since, 3) if r.busy_since else None,
                "stuck": bool(r.alive and r.busy_since and now - r.busy_since > stuck_after),
                "last_exit": r.exit_code if r.exit_code is not None else r.last_exit,
                "restarts": r.restarts,
                "targets": sorted(r.targets),
            } for r in self.ranks if r is not None],
            "active_calls": list(self.calls),
        }

    async def shutdown(self) -> None:
        for r in self.ranks:
            if r is not None:
                r.kill()
        await asyncio.gather(*(r.wait_dead(2) for r in self.ranks if r is not None))
        with contextlib.suppress(OSError):
            os.unlink(self.pod_ips_file)
