"""Replica routing: the mode of an autoscaled deployment (``Compute.autoscale``) as the caller
sees it: interchangeable replicas, each call on exactly one of them, chosen by load.

Each replica is a world of one pod (RANK 0, WORLD_SIZE 1) running the same launch. The
:class:`Routing` mode:

- **routes** every call to the ready replica with the fewest calls in flight, never more than
  ``concurrency`` per replica (Knative's ``containerConcurrency``); calls beyond that wait
  here, and count as load;
- **keeps the code current**: the launch is written where replicas started later read it
  (``Serving.write_launch``, which gives it the service's next generation) and pushed to every
  running replica; a replica takes calls only once it reports that launch
  (``/health?ready=1``), so no call runs old code after ``.to()``; a replica refuses a launch
  of a lower generation than its own, so the newest ``.to()`` wins, and a handle whose launch
  is refused stops routing (a newer ``.to()`` replaced it);
- **scales** through its :class:`ktlite.modes.serving.ReplicaScaler` (a thread: ktlite's own
  autoscaler on the local backend, or following the cluster's on Kubernetes);
- **never retries** a call a replica may have run: a replica lost mid-call fails that call
  (naming the replica), leaves the routing, and the next call goes elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import Any

from ktlite.backends.base import Applied, Backend, PodEndpoint
from ktlite.backends.capabilities import ClientScaling, Serving, optional, require
from ktlite.errors import (
    ConfigError,
    DeployError,
    KtliteError,
    LaunchTimeout,
    NotDeployedError,
    PodUnreachable,
    RemoteError,
    StaleLaunch,
)
from ktlite.modes import callids
from ktlite.modes.callpath import (
    CallOptions,
    CallPath,
    CallPlans,
    pool,
    print_log,
    shm_arguments,
)
from ktlite.modes.mode import Mode
from ktlite.modes.outcomes import split, to_error
from ktlite.modes.replicas import Replica, ReplicaSet
from ktlite.modes.serving import ReplicaScaler, autoscale_of
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire.launch import Launch
from ktlite_wire.status import Status

logger = logging.getLogger(__name__)


class Routing(Mode):
    """Each call on one replica, chosen by load; see the module docstring. Its ``status()``
    is a dict: ``launch_id`` and ``generation`` (this handle's launch), ``replicas`` (each
    ``name``, ``ip``, ``inflight``, ``served``, ``draining``,
    ``launch_id``), ``waiting`` (calls queued here) and ``autoscaler`` (who scales, the
    bounds, the target, the last decision and why)."""

    single = True

    def __init__(self, dep: CallPath) -> None:
        super().__init__(dep)
        self.pool = ReplicaSet()
        self.scaler = ReplicaScaler(dep, self.pool)
        self._pushing = threading.Lock()
        self.plans = CallPlans()

    # ---- deploy -------------------------------------------------------------------------

    @classmethod
    def shape(
        cls, spec: DeploymentSpec, backend: Backend, existing: Applied | None
    ) -> DeploymentSpec:
        """A redeploy keeps the replicas that run (within the bounds); the autoscaler goes on."""
        a = autoscale_of(spec)
        if require(backend, Serving).autoscaler(spec) != "client" or existing is None:
            return spec
        return replace(
            spec,
            replicas=min(
                max(len(existing.endpoints), a.initial), a.max_scale or len(existing.endpoints) or 1
            ),
        )

    def deployed(self) -> None:
        scaling = optional(self.dep.backend, ClientScaling)
        if self.dep.spec.detached and scaling is not None:
            scaling.supervise(self.dep.name)  # scales it once this process is gone

    def launch_fields(self) -> dict[str, Any]:
        # every replica is a world of one: RANK 0 of its own, whatever its pod ordinal
        return {"pod_ips": ["127.0.0.1"], "replica": True, "single": True}

    def load(self, launch: Launch, store: concurrent.futures.Future[Any]) -> None:
        """Write the launch where new replicas read it, then load it on every running
        replica; returns once each runs it (the replicas that took calls with the old code
        take new calls only with the new). Raises StaleLaunch where a replica holds the launch
        of a newer ``.to()`` of the service (one that went ahead of this one)."""
        dep = self.dep
        timeout = dep.spec.pod.calls.launch_timeout
        with self._pushing:
            # the next generation of the service's launches, taken where the launch is kept:
            # a replica refuses a launch older than the one it holds (StaleLaunch)
            current = require(dep.backend, Serving).write_launch(
                dep.name, replace(launch, store=store.result())
            )
            body = current.encode()
            self.pool.launch = current
            with self.pool.cond:  # old replicas take no calls until they report the new launch
                for r in self.pool.replicas.values():
                    r.launch_id = ""
            eps = list(dep.applied.endpoints)
            try:
                outcomes = list(pool.map(lambda ep: self._load_on(ep, body, timeout), eps))
            except StaleLaunch as e:
                raise StaleLaunch(
                    f"this .to() of {dep.name!r} (launch {dep.launch_id}, generation "
                    f"{current.generation}) was overtaken by a newer .to() of the service while "
                    "it loaded its code; the replicas keep the newer code: use the handle the "
                    f"newer .to() returned, or call .to() again ({e})"
                ) from e
        failures, values = split([o for outs in outcomes for o in outs])
        if failures:
            raise to_error(failures, values, f"deploying {dep.name!r} failed", DeployError)
        with self.pool.cond:
            for ep in eps:
                self.pool.admit(ep, dep.launch_id)
            self.pool.everyone()
        self.scaler.start()

    def adopt(self) -> None:
        """Attach to a running service without code of our own (``kt.cls(name=...)``,
        ``get_if_exists``): route to the replicas that run its current launch (replicas started
        later load it from the launch file)."""
        dep = self.dep
        ids: dict[str, str] = {}
        generations: dict[str, int] = {}  # by launch id
        for ep in dep.applied.endpoints:
            with contextlib.suppress(KtliteError):
                health = dep.client.ready(ep.url, timeout=2.0)
                if health is not None and health.get("launch_id"):
                    ids[ep.name] = str(health["launch_id"])
                    generations[ids[ep.name]] = int(health.get("generation") or 0)
        if ids:  # the newest launch: the highest generation (of equals, the one most run)
            runs = list(ids.values())
            dep.launch_id = max(set(runs), key=lambda i: (generations[i], runs.count(i)))
        with self.pool.cond:
            for ep in dep.applied.endpoints:
                if ids.get(ep.name) == dep.launch_id:
                    self.pool.admit(ep, dep.launch_id)
        self.scaler.start()

    def _load_on(self, ep: PodEndpoint, launch: bytes, timeout: float) -> list[Any]:
        """Wait for the replica's server, then load ``launch`` (once per launch per pod)."""
        self.dep.wait_healthy(ep.url, timeout)
        outs: list[Any] = self.dep.client.deploy(ep.url, launch, timeout + 30)
        return outs

    def check_colocation(self, target: str) -> None:
        raise ConfigError(
            f"{self.dep.name!r} is an autoscaled service; colocating {target!r} into its "
            "replicas is not supported (replicas come and go); deploy it on its own Compute"
        )

    # ---- calls --------------------------------------------------------------------------

    def parallel_calls(self) -> int:
        """Many calls in flight (up to ``concurrency`` per replica, the rest wait here for a
        free replica and count as load for the autoscaler)."""
        a = autoscale_of(self.dep.spec)
        most = (a.max_scale or self.scaler.max_replicas) * self.dep.spec.concurrency
        return max(4, min(256, most * 2))

    def call(
        self,
        parts: list[Any],
        options: CallOptions,
        log: Any = None,
        on_send: Any = None,
        per_rank: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run one call on one replica; returns ``[value]``."""
        if per_rank is not None or options.workers is not None or options.ranks is not None:
            raise ConfigError(
                f"{self.dep.name!r} is an autoscaled service: a call runs on one replica, "
                "so per-rank data, workers= and ranks= do not apply"
            )
        return self._call_one(parts, options, log, on_send, resent=False)

    def _call_one(
        self, parts: list[Any], options: CallOptions, log: Any, on_send: Any, resent: bool
    ) -> list[Any]:
        replica = self._acquire(options)
        try:
            return self._call_on(replica, parts, options, log, on_send, resent)
        finally:
            with self.pool.cond:
                replica.inflight -= 1
                replica.served += 1
                self.pool.load.finished.append(time.monotonic())
                self.pool.next_in_line()  # a slot is free

    def _acquire(self, options: CallOptions) -> Replica:
        """The ready replica with the fewest calls in flight and room for one more; waits
        (counted as load) while none has room, bounded by the launch timeout plus the call's."""
        dep, p = self.dep, self.pool
        c = dep.spec.pod.calls
        limit = c.launch_timeout + (options.timeout or c.call_timeout or c.launch_timeout)
        deadline = time.monotonic() + limit
        with p.cond:
            if dep.closed:
                raise NotDeployedError(f"deployment {dep.name!r} was torn down; call .to() again")
            if p.stale:
                raise NotDeployedError(p.stale)
            p.waiting += 1
            p.load.last_call = time.monotonic()
            waiter = threading.Condition(p.lock)  # woken alone when its turn may have come
            p.line.append(waiter)  # first come, first served: a caller that just ended a call
            try:  # and calls again queues behind the ones already waiting
                while True:
                    free = [
                        r
                        for r in p.replicas.values()
                        if r.launch_id == dep.launch_id
                        and not r.draining
                        and r.inflight < dep.spec.concurrency
                    ]
                    if free and p.line[0] is waiter:
                        best = min(free, key=lambda r: (r.inflight + r.others, r.served))
                        best.inflight += 1
                        return best
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._no_replica(limit)
                    if not free:  # no room: a cluster's replicas are looked up at the next tick
                        self.scaler.no_room()
                    if dep.closed or p.stale:
                        raise NotDeployedError(
                            p.stale
                            or f"deployment {dep.name!r} was torn down while "
                            "this call waited for a replica"
                        )
                    waiter.wait(min(left, 1.0))
            finally:
                p.line.remove(waiter)
                p.waiting -= 1
                p.next_in_line()  # the next in line may go

    def _no_replica(self, waited: float) -> KtliteError:
        dep = self.dep
        busy = (
            ", ".join(f"{r.ep.name}: {r.inflight}" for r in self.pool.replicas.values()) or "none"
        )
        return LaunchTimeout(
            f"no replica of {dep.name!r} had room for this call within {waited:g}s (calls in flight per "
            f"replica: {busy}; at most {dep.spec.concurrency} each; {autoscale_of(dep.spec).describe()})"
            f"{self.scaler.why()}. Raise max_scale or concurrency, pass a longer timeout=, or see "
            f"`ktlite status {dep.name}`"
        )

    def _call_on(
        self,
        replica: Replica,
        parts: list[Any],
        options: CallOptions,
        log: Any,
        on_send: Any,
        resent: bool,
    ) -> list[Any]:
        """The call on ``replica``. One no replica started (a 409: it runs another launch; a
        connection refused) goes to another replica, once."""
        dep = self.dep
        ep = replica.ep
        call_id = callids.new()  # unique, without a system call that lets go of the GIL
        if on_send is not None:
            on_send(call_id)
        plan = self.plans.plan(dep.spec, dep.launch_id, [ep], options, call_id=call_id, num_proc=1)
        try:
            with shm_arguments(dep.applied, plan, parts) as sent:
                log = (log or print_log) if plan.stream_logs else None
                reply = dep.client.call(ep.url, plan, sent.parts, log, None, pod=ep.name)
                sent.done(reply)
        except NotDeployedError as e:
            # 409 before anything ran: the replica runs another launch (or none); it leaves the
            # routing until it reports ours, and the call may safely go to another replica
            self.evict(replica, f"it answered: {e}")
            if resent:
                raise
            return self._call_one(parts, options, log, on_send, resent=True)
        except PodUnreachable as e:
            self.evict(replica, str(e))
            if not e.delivered and not resent:
                return self._call_one(parts, options, log, on_send, resent=True)
            raise PodUnreachable(
                f"replica {ep.name} of {dep.name!r} went away during the call, which may have run there, so "
                f"it is not sent again; the next call goes to another replica.\n{e}",
                delivered=True,
            ) from e
        failures, values = split(reply.outcomes)
        if failures:
            error = to_error(
                failures, values, f"call to {dep.name!r} on replica {ep.name}", RemoteError
            )
            if any(f.kind in (Status.DIED, Status.UNREACHABLE, Status.STALE) for f in failures):
                self.evict(replica, failures[0].message)
                if isinstance(error, RemoteError):
                    error.args = (
                        f"{error.args[0]}\nreplica {ep.name} lost the call; it is not sent again (it "
                        "may have run); the next call goes to another replica",
                    )
            raise error
        return [values[r] for r in sorted(values)]

    def evict(self, replica: Replica, why: str) -> None:
        """Stop routing to ``replica``; the scaling thread looks at it again at once."""
        with self.pool.cond:
            if self.pool.replicas.get(replica.ep.name) is replica:
                replica.launch_id = ""
        logger.warning(
            "%s: replica %s left the routing (%s)",
            self.dep.name,
            replica.ep.name,
            why.splitlines()[0][:200],
        )
        self.scaler.urge()

    # ---- status and lifecycle ---------------------------------------------------------------

    def status(self, stuck_after: float | None = None) -> dict[str, Any]:
        """The replicas (each with its calls in flight and its pod status), the calls waiting
        here, and the autoscaler's view; see the class docstring."""
        dep = self.dep
        with self.pool.cond:
            replicas = sorted(self.pool.replicas.values(), key=lambda r: r.ep.ordinal)
            waiting = self.pool.waiting

        def one(r: Replica) -> dict[str, Any]:
            row = r.describe()
            try:
                row["pod"] = dep.client.status(r.ep.url, stuck_after)
                row["inflight"] = max(r.inflight, len(row["pod"].get("active_calls") or []))
            except KtliteError as e:
                row["pod"], row["error"] = None, str(e)
            return row

        return {
            "name": dep.name,
            "launch_id": dep.launch_id,
            # this handle's launch generation (None: attached by name, with no code of its own)
            "generation": self.pool.launch.generation if self.pool.launch else None,
            "waiting": waiting,
            "replicas": list(pool.map(one, replicas)),
            "autoscaler": self.scaler.autoscaler_info(),
        }

    def scaling_status(self) -> dict[str, Any]:
        return self.scaler.scaling_status()

    def restart_failed(self) -> dict[str, Any]:
        raise ConfigError(
            f"{self.dep.name!r} is an autoscaled service: a replica whose process died leaves "
            "the routing and is replaced; nothing to restart by hand"
        )

    def stop(self) -> None:
        self.scaler.stop()
        with self.pool.cond:
            self.pool.everyone()
