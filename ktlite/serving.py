"""An autoscaled deployment (``Compute.autoscale``) as the caller sees it: interchangeable
replicas, each call on exactly one of them, chosen by load.

Each replica is a world of one pod (RANK 0, WORLD_SIZE 1) running the same launch. The
caller's :class:`ServingDeployment`:

- **routes** every call to the ready replica with the fewest calls in flight, never more than
  ``concurrency`` per replica (Knative's ``containerConcurrency``); calls beyond that wait
  here, and count as load;
- **keeps the code current**: the launch is written where replicas started later read it
  (``Backend.write_launch``) and pushed to every running replica; a replica takes calls only
  once it reports that launch (``/health?ready=1``), so no call runs old code after ``.to()``;
- **scales**, on backends where ktlite is the autoscaler (local): a thread samples the load
  (calls in flight and waiting; or calls per second; or the replicas' CPU) and follows
  :class:`ktlite.autoscaling.Scaler`, starting replicas (``Backend.apply`` with
  ``spec.replicas``) and stopping them once drained; on Kubernetes the cluster scales (an HPA
  or Knative) and the thread follows the replicas it reports;
- **never retries** a call a replica may have run: a replica lost mid-call fails that call
  (naming the replica), leaves the routing, and the next call goes elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ktlite import autoscalers
from ktlite.autoscaling import Decision, Scaler
from ktlite.backends.base import Applied, Backend, PodEndpoint
from ktlite.backends.capabilities import ClientScaling, Serving, Waking, optional, require
from ktlite.deploy import Deployment, _pool, _split, _to_error, print_log, shm_arguments
from ktlite.deployment_spec import DeploymentSpec
from ktlite.errors import (
    ConfigError,
    DeployError,
    KtliteError,
    LaunchTimeout,
    NotDeployedError,
    PodUnreachable,
    RemoteError,
)
from ktlite.launch import build_launch
from ktlite.serving_status import AutoscalerReport
from ktlite_wire.status import Status

# how often the scaling thread samples the load and looks at the replicas
TICK_S = 0.25
# how often it asks a cluster that scales by itself (an HPA, Knative) which replicas run;
# at once when a call found no replica with room or a replica left the routing
CLUSTER_REFRESH_S = 2.0
logger = logging.getLogger(__name__)


@dataclass
class Replica:
    """One replica as the router sees it."""

    ep: PodEndpoint
    inflight: int = 0  # this caller's calls running on it
    reported: int = 0  # the calls its server says it runs (every caller's)
    others: int = 0  # of those, the calls of other callers (the server's count less ours then)
    served: int = 0  # calls it finished for this caller
    draining: bool = False  # takes no new calls: it stops once idle
    launch_id: str = ""  # the launch it reported loaded

    def describe(self) -> dict[str, Any]:
        return {"name": self.ep.name, "ip": self.ep.ip, "inflight": self.inflight + self.others,
                "served": self.served, "draining": self.draining, "launch_id": self.launch_id}


@dataclass
class _Load:
    """What the scaling thread measures between two ticks."""

    finished: list[float] = field(default_factory=list)  # when calls ended (for rps)
    last_call: float | None = None


class ServingDeployment(AutoscalerReport, Deployment):
    """An autoscaled deployment; see the module docstring. Its ``status()`` is a dict: ``replicas`` (each ``name``, ``ip``, ``inflight``,
    ``served``, ``draining``, ``launch_id``), ``waiting`` (calls queued here) and
    ``autoscaler`` (who scales, the bounds, the target, the last decision and why)."""

    def __init__(self, spec: DeploymentSpec, backend: Backend, applied: Applied) -> None:
        super().__init__(spec, backend, applied)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._replicas: dict[str, Replica] = {}
        self._waiting = 0
        self._line: deque[threading.Condition] = deque()  # calls waiting for a replica, in arrival order
        self._load = _Load()
        self._launch: bytes | None = None
        self._scaler = Scaler(self.spec.autoscale, max_default=os.cpu_count() or 1)
        self._who = require(self.backend, Serving).autoscaler(self.spec)
        self._decision: Decision | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scale_error: str | None = None
        self._stale: str | None = None  # set when another .to() replaced this handle's code
        self._leading = False  # this process scales the deployment (see _lead)
        self._published = 0  # the waiting calls this process last told the one that scales
        self._usage_at = (0.0, 0.0)
        self._refreshed = 0.0  # when the replicas were last looked up
        self._urgent = False  # look them up at the next tick
        self._waking: threading.Thread | None = None  # asking Knative for a replica (scaled to zero)  # when the replicas' CPU/memory was last read, and its sum
        self._pushing = threading.Lock()
        self._submit_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ---- code ---------------------------------------------------------------------------

    def push(self, bundle: bytes, sources: dict[str, Any], init: bytes | None, restart: bool = False) -> None:
        """Write the launch where new replicas read it, then load it on every running
        replica; returns once each runs it (the replicas that took calls with the old code
        take new calls only with the new)."""
        from ktlite.store import handoff

        self._code = (bundle, sources, init)
        self.launch_id = uuid.uuid4().hex[:12]
        timeout = self.spec.compute.launch_timeout
        launch = build_launch(self.spec, launch_id=self.launch_id, code=(bundle, sources, init),
                              pod_ips=["127.0.0.1"], master_port=self.applied.master_port, restart=restart,
                              single=True, replica=True, store=handoff(self.backend)).encode()
        with self._pushing:
            require(self.backend, Serving).write_launch(self.name, launch)
            self._launch = launch
            with self._cond:  # old replicas take no calls until they report the new launch
                for r in self._replicas.values():
                    r.launch_id = ""
            eps = list(self.applied.endpoints)
            outcomes = list(_pool.map(lambda ep: self._load_on(ep, launch, timeout), eps))
        failures, values = _split([o for outs in outcomes for o in outs])
        if failures:
            raise _to_error(failures, values, f"deploying {self.name!r} failed", DeployError)
        with self._cond:
            for ep in eps:
                self._admit(ep)
            self._everyone()
        self._start_thread()

    def adopt(self) -> None:
        """Attach to a running service without code of our own (``kt.cls(name=...)``,
        ``get_if_exists``): route to the replicas that run its current launch (replicas started
        later load it from the launch file)."""
        ids = {}
        for ep in self.applied.endpoints:
            with contextlib.suppress(KtliteError):
                health = self.client.ready(ep.url, timeout=2.0)
                if health is not None and health.get("launch_id"):
                    ids[ep.name] = health["launch_id"]
        if ids:  # the newest launch is the one most replicas run once a rollout ends
            self.launch_id = max(set(ids.values()), key=list(ids.values()).count)
        with self._cond:
            for ep in self.applied.endpoints:
                if ids.get(ep.name) == self.launch_id:
                    self._admit(ep)
        self._start_thread()

    def _load_on(self, ep: PodEndpoint, launch: bytes, timeout: float) -> list[Any]:
        """Wait for the replica's server, then load ``launch`` (once per launch per pod)."""
        self._wait_healthy(ep.url, timeout)
        outs: list[Any] = self.client.deploy(ep.url, launch, timeout + 30)
        return outs

    def _admit(self, ep: PodEndpoint) -> None:
        """Route calls to ``ep`` from now on (it runs the current launch). Holds ``_cond``."""
        replica = self._replicas.get(ep.name)
        if replica is None or replica.ep.incarnation != ep.incarnation:
            replica = self._replicas[ep.name] = Replica(ep)
        replica.launch_id = self.launch_id
        replica.draining = False

    # ---- calls --------------------------------------------------------------------------

    def submit(self, method: str | None, parts: list[Any], options: Any, future: Any,
               per_rank: dict[str, Any] | None = None) -> Any:
        """Queue one call; many may be in flight (up to ``concurrency`` per replica, the rest
        wait here for a free replica and count as load for the autoscaler)."""
        with self._queue_lock:
            if self._closed:
                raise NotDeployedError(f"deployment {self.name!r} was torn down; call .to() again")
            if self._submit_pool is None:
                a = self.spec.autoscale
                most = (a.max_scale or self._scaler.max) * self.spec.concurrency
                self._submit_pool = concurrent.futures.ThreadPoolExecutor(
                    max(4, min(256, most * 2)), thread_name_prefix=f"ktlite-{self.name}")
            self._queue = self._submit_pool
            self._queued.add(future)
            self._submit_pool.submit(self._run_submitted, method, parts, options, future, per_rank)
        return future

    def call(self, method: str | None, parts: list[Any], options: Any, log: Any = None,
             on_send: Any = None, per_rank: dict[str, Any] | None = None) -> list[Any]:
        """Run one call on one replica; returns ``[value]``."""
        if per_rank is not None or options.workers is not None or options.ranks is not None:
            raise ConfigError(f"{self.name!r} is an autoscaled service: a call runs on one replica, "
                              "so per-rank data, workers= and ranks= do not apply")
        return self._call_one(parts, options, log, on_send, resent=False)

    def _call_one(self, parts: list[Any], options: Any, log: Any, on_send: Any, resent: bool) -> list[Any]:
        replica = self._acquire(options)
        try:
            return self._call_on(replica, parts, options, log, on_send, resent)
        finally:
            with self._cond:
                replica.inflight -= 1
                replica.served += 1
                self._load.finished.append(time.monotonic())
                self._next_in_line()  # a slot is free

    def _acquire(self, options: Any) -> Replica:
        """The ready replica with the fewest calls in flight and room for one more; waits
        (counted as load) while none has room, bounded by the launch timeout plus the call's."""
        c = self.spec.compute
        limit = c.launch_timeout + (options.timeout or c.call_timeout or c.launch_timeout)
        deadline = time.monotonic() + limit
        with self._cond:
            if self._closed:
                raise NotDeployedError(f"deployment {self.name!r} was torn down; call .to() again")
            if self._stale:
                raise NotDeployedError(self._stale)
            self._waiting += 1
            self._load.last_call = time.monotonic()
            waiter = threading.Condition(self._lock)  # woken alone when its turn may have come
            self._line.append(waiter)  # first come, first served: a caller that just ended a call
            try:                       # and calls again queues behind the ones already waiting
                while True:
                    free = [r for r in self._replicas.values() if r.launch_id == self.launch_id
                            and not r.draining and r.inflight < self.spec.concurrency]
                    if free and self._line[0] is waiter:
                        best = min(free, key=lambda r: (r.inflight + r.others, r.served))
                        best.inflight += 1
                        return best
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._no_replica(limit)
                    if not free:  # no room: a cluster's replicas are looked up at the next tick
                        self._urgent = True
                        if not self._replicas and self._who == "knative":
                            self._wake_knative()
                    if self._closed or self._stale:
                        raise NotDeployedError(self._stale or f"deployment {self.name!r} was torn down while "
                                               "this call waited for a replica")
                    waiter.wait(min(left, 1.0))
            finally:
                self._line.remove(waiter)
                self._waiting -= 1
                self._next_in_line()  # the next in line may go

    def _wake_knative(self) -> None:
        """No replica (Knative scaled to zero): ask Knative's activator for one, in the
        background (it answers once the replica does). Holds the lock."""
        if self._waking is not None and self._waking.is_alive():
            return
        waking = optional(self.backend, Waking)
        if waking is None:
            return

        def run() -> None:
            with contextlib.suppress(Exception):  # a failed wake leaves the call to its timeout
                waking.wake(self.name, self.spec.compute.launch_timeout)
            self._urgent = True
            self._wake.set()
        self._waking = threading.Thread(target=run, name=f"ktlite-wake-{self.name}", daemon=True)
        self._waking.start()

    def _next_in_line(self) -> None:
        """Wake the first waiting call (only it may take a free slot). Holds the lock."""
        if self._line:
            self._line[0].notify()

    def _everyone(self) -> None:
        """Wake every waiting call: replicas, code or the deployment changed. Holds the lock."""
        for waiter in self._line:
            waiter.notify()
        self._cond.notify_all()

    def _no_replica(self, waited: float) -> KtliteError:
        busy = ", ".join(f"{r.ep.name}: {r.inflight}" for r in self._replicas.values()) or "none"
        why = f"; the autoscaler's last step: {self._decision.reason}" if self._decision else ""
        if self._scale_error:
            why += f"; starting replicas failed: {self._scale_error}"
        return LaunchTimeout(
            f"no replica of {self.name!r} had room for this call within {waited:g}s (calls in flight per "
            f"replica: {busy}; at most {self.spec.concurrency} each; {self.spec.autoscale.describe()}){why}. "
            f"Raise max_scale or concurrency, pass a longer timeout=, or see `ktlite status {self.name}`")

    def _call_on(self, replica: Replica, parts: list[Any], options: Any, log: Any, on_send: Any,
                 resent: bool) -> list[Any]:
        """The call on ``replica``. One no replica started (a 409: it runs another launch; a
        connection refused) goes to another replica, once."""
        ep = replica.ep
        d = self.spec.distributed
        stream = self.spec.compute.stream_logs if options.stream_logs is None else options.stream_logs
        call_id = uuid.uuid4().hex
        if on_send is not None:
            on_send(call_id)
        meta: dict[str, Any] = {
            "id": call_id, "launch_id": self.launch_id, "pods": [ep.peer_url], "names": [ep.name],
            "workers": None, "timeout": options.timeout if options.timeout is not None else self.spec.compute.call_timeout,
            "stream_logs": stream, "restart": options.restart_procs, "fanout": True,
            "quorum_timeout": d.quorum_timeout, "num_proc": 1}
        try:
            with shm_arguments(self.applied, meta, parts) as sent:
                reply = self.client.call(ep.url, meta, sent, (log or print_log) if stream else None, None,
                                         pod=ep.name)
        except NotDeployedError as e:
            # 409 before anything ran: the replica runs another launch (or none); it leaves the
            # routing until it reports ours, and the call may safely go to another replica
            self._evict(replica, f"it answered: {e}")
            if resent:
                raise
            return self._call_one(parts, options, log, on_send, resent=True)
        except PodUnreachable as e:
            self._evict(replica, str(e))
            if not e.delivered and not resent:
                return self._call_one(parts, options, log, on_send, resent=True)
            raise PodUnreachable(
                f"replica {ep.name} of {self.name!r} went away during the call, which may have run there, so "
                f"it is not sent again; the next call goes to another replica.\n{e}", delivered=True) from e
        failures, values = _split(reply.outcomes)
        if failures:
            error = _to_error(failures, values, f"call to {self.name!r} on replica {ep.name}", RemoteError)
            if any(f.kind in (Status.DIED, Status.UNREACHABLE, Status.STALE) for f in failures):
                self._evict(replica, failures[0].message)
                if isinstance(error, RemoteError):
                    error.args = (f"{error.args[0]}\nreplica {ep.name} lost the call; it is not sent again (it "
                                  "may have run); the next call goes to another replica",)
            raise error
        return [values[r] for r in sorted(values)]

    def _evict(self, replica: Replica, why: str) -> None:
        """Stop routing to ``replica``; the scaling thread looks at it again at once."""
        with self._cond:
            if self._replicas.get(replica.ep.name) is replica:
                replica.launch_id = ""
        logger.warning("%s: replica %s left the routing (%s)", self.name, replica.ep.name, why.splitlines()[0][:200])
        self._urgent = True
        self._wake.set()

    # ---- the scaling thread -------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is None:
            # a new autoscaler has no history: the replicas running now (initial_scale's at a
            # deploy) count as wanted now, so they stay at least scale_down_delay
            self._scaler.started(time.monotonic(), len(self.applied.endpoints))
            autoscalers.track(self)  # stopped at exit before the backend and the client
            self._thread = threading.Thread(target=self._loop, name=f"ktlite-scale-{self.name}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(TICK_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._tick()
                self._scale_error = None
            except Exception as e:  # noqa: BLE001 - shown by status and by waiting calls' errors
                if self._stop.is_set():  # closed (or exiting) mid-step: nobody waits on it
                    logger.debug("%s: scaling step ended by close: %r", self.name, e)
                    return
                self._scale_error = f"{type(e).__name__}: {str(e)[:500]}"
                logger.warning("%s: scaling: %s", self.name, self._scale_error)
                self._stop.wait(1.0)

    def _tick(self) -> None:
        if self._who == "client" or self._urgent or time.monotonic() - self._refreshed >= CLUSTER_REFRESH_S:
            self._urgent = False
            self._refresh()
        if self._who != "client" or self._stop.is_set():
            return
        if not self._lead():
            return  # another process scales this deployment; it counts our waiting calls
        now = time.monotonic()
        metric = self.spec.autoscale.metric_name
        # what takes I/O is read before the lock that calls take
        usage = self._usage(metric) if metric in ("cpu", "memory") else 0.0
        others = optional(self.backend, ClientScaling)
        elsewhere = others.waiting_elsewhere(self.name) if others is not None else 0
        with self._cond:
            current = len([r for r in self._replicas.values() if not r.draining])
            load = usage if metric in ("cpu", "memory") else self._measure(now, elsewhere)
            if load > 0:
                self._load.last_call = now
            last_call = self._load.last_call
        decision = self._scaler.decide(now, load, current, last_call)
        changed = self._decision is None or (decision.desired, decision.current) != \
            (self._decision.desired, self._decision.current)
        self._decision = decision
        if changed:
            self._record()
        if decision.desired > current:
            self._scale_to(decision.desired)
        elif decision.desired < current:
            self._drain(current - decision.desired)
        self._fill_gaps()
        self._stop_drained()

    def _lead(self) -> bool:
        """Whether this process is the deployment's one autoscaler (the backend's lock: every
        process that calls a local deployment routes, one scales). The others publish the
        calls waiting in them, which the one that scales counts as load."""
        if self._leading:
            return True
        scaling = optional(self.backend, ClientScaling)
        if scaling is None:
            self._leading = True
            return True
        self._leading = scaling.lead_scaling(self.name)
        if not self._leading:
            with self._cond:
                waiting = self._waiting
            if waiting != self._published:
                scaling.publish_waiting(self.name, waiting)
                self._published = waiting
        return self._leading

    def _measure(self, now: float, elsewhere: int) -> float:
        """The load now, summed over replicas (``elsewhere``: calls waiting in other
        processes). Holds ``_cond``."""
        self._load.finished = [t for t in self._load.finished if t >= now - 1.0]
        if self.spec.autoscale.metric_name == "rps":
            return float(len(self._load.finished))
        return float(sum(r.inflight + r.others for r in self._replicas.values()) + self._waiting + elsewhere)

    def _usage(self, metric: str) -> float:
        """The replicas' CPU percent (100 = one core) or memory (percent of ``memory``), read
        from their status at most once a second."""
        from ktlite.compute import parse_memory

        now = time.monotonic()
        if now - self._usage_at[0] < 1.0:
            return self._usage_at[1]
        total = 0.0
        for r in list(self._replicas.values()):
            with contextlib.suppress(KtliteError):
                rows = self.client.status(r.ep.url).get("ranks") or []
                if metric == "cpu":
                    total += sum(row.get("cpu_percent") or 0 for row in rows) / max(self.spec.compute.cpu_count or 1, 1e-9)
                elif self.spec.compute.memory:
                    total += 100 * sum(row.get("rss_bytes") or 0 for row in rows) / parse_memory(self.spec.compute.memory)
        self._usage_at = (now, total)
        return total

    def _refresh(self) -> None:
        """Follow the replicas the backend reports: new ones get the current launch before
        they take calls, gone ones leave the routing; each one's own count of running calls."""
        self._refreshed = time.monotonic()
        current = self.backend.lookup(self.name)
        if current is None or current.token != self.applied.token:  # torn down (and maybe re-created)
            self._stop.set()
            with self._cond:
                self._replicas.clear()
                self._stale = f"deployment {self.name!r} was torn down; call .to() again"
                self._everyone()
            return
        by_name = {ep.name: ep for ep in current.endpoints}
        with self._cond:
            for name in [n for n, r in self._replicas.items()
                         if n not in by_name or by_name[n].incarnation != r.ep.incarnation]:
                del self._replicas[name]
            known = {n for n, r in self._replicas.items() if r.launch_id == self.launch_id}
        self.applied = current
        fresh = [ep for ep in current.endpoints if ep.name not in known]
        for ep in fresh:
            self._bring_up(ep)
        for ep in current.endpoints:
            if ep.name in known:
                with contextlib.suppress(KtliteError):
                    health = self.client.health(ep.url, timeout=1.0)
                    if health.get("launch_id") not in (None, self.launch_id):
                        self._superseded(ep, str(health.get("launch_id")))
                        return
                    with self._cond:
                        r = self._replicas.get(ep.name)
                        if r is not None:
                            r.reported = int(health.get("calls") or 0)
                            r.others = max(0, r.reported - r.inflight)
        with self._cond:
            self._everyone()

    def _superseded(self, ep: PodEndpoint, theirs: str) -> None:
        """Another ``.to()`` (this process or another) deployed new code: this handle stops
        scaling and routing; its calls fail saying so."""
        self._stop.set()
        with self._cond:
            self._replicas.clear()
            self._stale = (f"deployment {self.name!r} was redeployed by another .to() (replica {ep.name} runs "
                           f"launch {theirs}, this handle's is {self.launch_id}); use the new handle, or "
                           "call .to() again")
            self._everyone()

    def _bring_up(self, ep: PodEndpoint) -> None:
        """A replica not routed yet: route to it once it runs the current launch (it loads it
        at boot from the launch file; one that has another is sent it)."""
        try:
            health = self.client.ready(ep.url, timeout=1.0)
        except KtliteError:
            return  # not answering yet: next tick
        if health is not None and not self.launch_id and self._launch is None:
            self.launch_id = str(health.get("launch_id") or "")  # attached with no replica running
        if health is not None and health.get("launch_id") == self.launch_id:
            with self._cond:
                self._admit(ep)
            return
        if health is None:
            # booting (loading the launch file) or no code: a launch is sent only to a pod
            # that has none, so a boot that is loading the current launch finishes on its own
            try:
                plain = self.client.health(ep.url, timeout=1.0)
            except KtliteError:
                return
            if plain.get("launch_id") is not None:
                return
        if self._launch is None:
            return
        try:
            failures, _ = _split(self.client.deploy(ep.url, self._launch, self.spec.compute.launch_timeout + 30))
        except KtliteError:
            return
        if not failures:
            with self._cond:
                self._admit(ep)

    def _scale_to(self, count: int) -> None:
        """Start replicas until ``count`` run (the backend keeps the ones running)."""
        if self._stop.is_set():
            return
        with self._cond:
            for r in self._replicas.values():  # a draining replica is the quickest to get back
                if r.draining and count > len([x for x in self._replicas.values() if not x.draining]):
                    r.draining = False
        running = len([r for r in self._replicas.values() if not r.draining])
        if count <= running:
            return
        started = time.monotonic()
        applied = require(self.backend, ClientScaling).scale(self.name, self.applied.token, count)
        self.applied = applied
        self._refresh()
        logger.info("%s: %d -> %d replicas in %.2fs", self.name, running, count, time.monotonic() - started)

    def _drain(self, how_many: int) -> None:
        """Mark the ``how_many`` highest replicas draining: they finish their calls, take no
        new ones, and stop once idle (the backend stops the highest ordinals)."""
        with self._cond:
            live = sorted((r for r in self._replicas.values() if not r.draining), key=lambda r: r.ep.ordinal)
            for r in live[len(live) - how_many:]:
                r.draining = True

    def _fill_gaps(self) -> None:
        """Replace a replica that died below the highest one that runs (the backend starts
        and stops by ordinal: the highest go first when scaling down)."""
        with self._cond:
            live = sorted(r.ep.ordinal for r in self._replicas.values() if not r.draining)
            if not live or live[-1] + 1 == len(live) or any(r.draining for r in self._replicas.values()):
                return
        self.applied = require(self.backend, ClientScaling).scale(self.name, self.applied.token, live[-1] + 1)
        self._refresh()

    def _stop_drained(self) -> None:
        with self._cond:
            draining = [r for r in self._replicas.values() if r.draining]
            if not draining or any(r.inflight or r.reported for r in draining):
                return
            keep = len(self._replicas) - len(draining)
            # the backend stops the ordinals from ``keep`` up: only when those are the drained ones
            if any(r.ep.ordinal >= keep for r in self._replicas.values() if not r.draining):
                return
        applied = require(self.backend, ClientScaling).scale(self.name, self.applied.token, keep)
        self.applied = applied
        with self._cond:
            for r in draining:
                self._replicas.pop(r.ep.name, None)

    # ---- status and lifecycle ---------------------------------------------------------------

    def status(self, stuck_after: float | None = None) -> dict[str, Any]:  # type: ignore[override]
        """The replicas (each with its calls in flight and its pod status), the calls waiting
        here, and the autoscaler's view; see the class docstring."""
        with self._cond:
            replicas = [r for r in sorted(self._replicas.values(), key=lambda r: r.ep.ordinal)]
            waiting = self._waiting

        def one(r: Replica) -> dict[str, Any]:
            row = r.describe()
            try:
                row["pod"] = self.client.status(r.ep.url, stuck_after)
                row["inflight"] = max(r.inflight, len(row["pod"].get("active_calls") or []))
            except KtliteError as e:
                row["pod"], row["error"] = None, str(e)
            return row

        return {"name": self.name, "launch_id": self.launch_id, "waiting": waiting,
                "replicas": list(_pool.map(one, replicas)), "autoscaler": self._autoscaler_info()}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._cond:
            self._everyone()
        super().close()
        if self._submit_pool is not None:
            self._submit_pool.shutdown(wait=False, cancel_futures=True)

    def fail_queued(self) -> None:
        self._stop.set()
        self._wake.set()
        super().fail_queued()
        with self._cond:
            self._everyone()

    def colocate(self, target: str, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(f"{self.name!r} is an autoscaled service; colocating {target!r} into its replicas "
                          "is not supported (replicas come and go); deploy it on its own Compute")

    def recolocate(self) -> None:
        return None

    def restart_failed(self) -> dict[str, Any]:
        raise ConfigError(f"{self.name!r} is an autoscaled service: a replica whose process died leaves the "
                          "routing and is replaced; nothing to restart by hand")
