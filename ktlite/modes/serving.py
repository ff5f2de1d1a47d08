"""The scaling of an autoscaled deployment (``Compute.autoscale``), in the calling process.

A :class:`ReplicaScaler` is a thread that looks at the replicas the backend reports: new ones
get the current launch before they take calls, gone ones leave the routing
(:class:`ktlite.modes.replicas.ReplicaSet`). On backends where ktlite is the autoscaler (local) it
samples the load (calls in flight and waiting; or calls per second; or the replicas' CPU) and
follows :class:`ktlite.specs.autoscaling.Scaler`, starting replicas (``Backend.scale``) and stopping
them once drained; on Kubernetes the cluster scales (an HPA or Knative) and the thread follows
the replicas it reports. The router that sends calls is :class:`ktlite.modes.routing.Routing`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from ktlite.backends.base import Backend, PodEndpoint
from ktlite.backends.capabilities import ClientScaling, Serving, Waking, optional, require
from ktlite.errors import KtliteError, StaleLaunch
from ktlite.modes import autoscalers
from ktlite.modes.callpath import CallPath
from ktlite.modes.outcomes import split
from ktlite.modes.replicas import Replica, ReplicaSet
from ktlite.modes.serving_status import AutoscalerReport
from ktlite.specs.autoscaling import AutoscaleConfig, Decision, Scaler
from ktlite.specs.deployment_spec import DeploymentSpec

# how often the scaling thread samples the load and looks at the replicas
TICK_S = 0.25
# how often it asks a cluster that scales by itself (an HPA, Knative) which replicas run;
# at once when a call found no replica with room or a replica left the routing
CLUSTER_REFRESH_S = 2.0
logger = logging.getLogger(__name__)


def autoscale_of(spec: DeploymentSpec) -> AutoscaleConfig:
    """``spec.autoscale``, which is set: the serving mode runs only a spec with it (``mode_for``)."""
    a = spec.autoscale
    assert a is not None, "the serving mode runs only deployments with autoscale set"
    return a


class ReplicaScaler(AutoscalerReport):
    """The scaling thread of one autoscaled deployment; see the module docstring."""

    def __init__(self, dep: CallPath, pool: ReplicaSet) -> None:
        self.dep, self.pool = dep, pool
        self._scaler = Scaler(autoscale_of(dep.spec), max_default=os.cpu_count() or 1)
        self._said_who: str | None = None  # the backend's answer, asked at first need
        self._decision: Decision | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scale_error: str | None = None
        self._leading = False  # this process scales the deployment (see _lead)
        self._published = 0  # the waiting calls this process last told the one that scales
        self._usage_at = (0.0, 0.0)  # when the replicas' CPU/memory was last read, and its sum
        self._refreshed = 0.0  # when the replicas were last looked up
        self._urgent = False  # look them up at the next tick
        self._waking: threading.Thread | None = (
            None  # asking Knative for a replica (scaled to zero)
        )

    @property
    def _who(self) -> str:
        """Who scales: ``"client"`` (this thread), ``"hpa"`` or ``"knative"`` (the cluster)."""
        if self._said_who is None:
            self._said_who = require(self.dep.backend, Serving).autoscaler(self.dep.spec)
        return self._said_who

    # what AutoscalerReport reads
    @property
    def name(self) -> str:
        return self.dep.name

    @property
    def backend(self) -> Backend:
        return self.dep.backend

    @property
    def spec(self) -> DeploymentSpec:
        return self.dep.spec

    @property
    def _replicas(self) -> dict[str, Replica]:
        return self.pool.replicas

    @property
    def max_replicas(self) -> int:
        """The most replicas it starts where ``max_scale`` is not set."""
        return self._scaler.max

    # ---- what the router asks of it ---------------------------------------------------------

    def urge(self) -> None:
        """Look at the replicas at the next tick, at once (one left the routing)."""
        self._urgent = True
        self._wake.set()

    def no_room(self) -> None:
        """A call found no replica with room. Holds the pool's lock."""
        self._urgent = True
        if not self.pool.replicas and self._who == "knative":
            self._wake_knative()

    def why(self) -> str:
        """Why no replica had room, as the scaler knows it (for a waiting call's error)."""
        why = f"; the autoscaler's last step: {self._decision.reason}" if self._decision else ""
        if self._scale_error:
            why += f"; starting replicas failed: {self._scale_error}"
        return why

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(max(0.0, timeout))

    def stopped(self, timeout: float) -> bool:
        """Whether the thread was told to stop, waiting up to ``timeout`` seconds for it."""
        return self._stop.wait(timeout)

    def _wake_knative(self) -> None:
        """No replica (Knative scaled to zero): ask Knative's activator for one, in the
        background (it answers once the replica does). Holds the pool's lock."""
        if self._waking is not None and self._waking.is_alive():
            return
        waking = optional(self.dep.backend, Waking)
        if waking is None:
            return
        wake = waking.wake

        def run() -> None:
            with contextlib.suppress(Exception):  # a failed wake leaves the call to its timeout
                wake(self.dep.name, self.dep.spec.pod.calls.launch_timeout)
            self._urgent = True
            self._wake.set()

        self._waking = threading.Thread(
            target=run, name=f"ktlite-wake-{self.dep.name}", daemon=True
        )
        self._waking.start()

    # ---- the thread ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scaling thread (once)."""
        if self._thread is None:
            # a new autoscaler has no history: the replicas running now (initial_scale's at a
            # deploy) count as wanted now, so they stay at least scale_down_delay
            self._scaler.started(time.monotonic(), len(self.dep.applied.endpoints))
            autoscalers.track(self)  # stopped at exit before the backend and the client
            self._thread = threading.Thread(
                target=self._loop, name=f"ktlite-scale-{self.dep.name}", daemon=True
            )
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
                    logger.debug("%s: scaling step ended by close: %r", self.dep.name, e)
                    return
                self._scale_error = f"{type(e).__name__}: {str(e)[:500]}"
                logger.warning("%s: scaling: %s", self.dep.name, self._scale_error)
                self._stop.wait(1.0)

    def _tick(self) -> None:
        if (
            self._who == "client"
            or self._urgent
            or time.monotonic() - self._refreshed >= CLUSTER_REFRESH_S
        ):
            self._urgent = False
            self._refresh()
        if self._who != "client" or self._stop.is_set():
            return
        if not self._lead():
            return  # another process scales this deployment; it counts our waiting calls
        now = time.monotonic()
        metric = autoscale_of(self.dep.spec).metric_name
        # what takes I/O is read before the lock that calls take
        usage = self._usage(metric) if metric in ("cpu", "memory") else 0.0
        others = optional(self.dep.backend, ClientScaling)
        elsewhere = others.waiting_elsewhere(self.dep.name) if others is not None else 0
        with self.pool.cond:
            current = len([r for r in self.pool.replicas.values() if not r.draining])
            load = usage if metric in ("cpu", "memory") else self._measure(now, elsewhere)
            if load > 0:
                self.pool.load.last_call = now
            last_call = self.pool.load.last_call
        decision = self._scaler.decide(now, load, current, last_call)
        changed = self._decision is None or (decision.desired, decision.current) != (
            self._decision.desired,
            self._decision.current,
        )
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
        scaling = optional(self.dep.backend, ClientScaling)
        if scaling is None:
            self._leading = True
            return True
        self._leading = bool(scaling.lead_scaling(self.dep.name))
        if not self._leading:
            with self.pool.cond:
                waiting = self.pool.waiting
            if waiting != self._published:
                scaling.publish_waiting(self.dep.name, waiting)
                self._published = waiting
        return self._leading

    def _measure(self, now: float, elsewhere: int) -> float:
        """The load now, summed over replicas (``elsewhere``: calls waiting in other
        processes). Holds ``_cond``."""
        self.pool.load.finished = [t for t in self.pool.load.finished if t >= now - 1.0]
        if autoscale_of(self.dep.spec).metric_name == "rps":
            return float(len(self.pool.load.finished))
        return float(
            sum(r.inflight + r.others for r in self.pool.replicas.values())
            + self.pool.waiting
            + elsewhere
        )

    def _usage(self, metric: str) -> float:
        """The replicas' CPU percent (100 = one core) or memory (percent of ``memory``), read
        from their status at most once a second."""
        now = time.monotonic()
        if now - self._usage_at[0] < 1.0:
            return self._usage_at[1]
        total = 0.0
        resources = self.dep.spec.pod.resources
        for r in list(self.pool.replicas.values()):
            with contextlib.suppress(KtliteError):
                rows = self.dep.client.status(r.ep.url).get("ranks") or []
                if metric == "cpu":
                    total += sum(row.get("cpu_percent") or 0 for row in rows) / max(
                        resources.cpus or 1, 1e-9
                    )
                elif resources.memory is not None:
                    total += (
                        100
                        * sum(row.get("rss_bytes") or 0 for row in rows)
                        / resources.memory.bytes
                    )
        self._usage_at = (now, total)
        return total

    def _refresh(self) -> None:
        """Follow the replicas the backend reports: new ones get the current launch before
        they take calls, gone ones leave the routing; each one's own count of running calls."""
        self._refreshed = time.monotonic()
        current = self.dep.backend.lookup(self.dep.name)
        if (
            current is None or current.token != self.dep.applied.token
        ):  # torn down (and maybe re-created)
            self._stop.set()
            self.pool.forget(f"deployment {self.dep.name!r} was torn down; call .to() again")
            return
        by_name = {ep.name: ep for ep in current.endpoints}
        with self.pool.cond:
            for name in [
                n
                for n, r in self.pool.replicas.items()
                if n not in by_name or by_name[n].incarnation != r.ep.incarnation
            ]:
                del self.pool.replicas[name]
            known = {n for n, r in self.pool.replicas.items() if r.launch_id == self.dep.launch_id}
        self.dep.applied = current
        # the replicas it routes to first: one that runs a newer .to()'s launch ends this
        # handle's routing before it sends its (older) launch to any new replica
        for ep in current.endpoints:
            if ep.name in known:
                with contextlib.suppress(KtliteError):
                    health = self.dep.client.health(ep.url, timeout=1.0)
                    if health.get("launch_id") not in (None, self.dep.launch_id):
                        self._superseded(f"replica {ep.name} runs launch {health['launch_id']}")
                        return
                    with self.pool.cond:
                        r = self.pool.replicas.get(ep.name)
                        if r is not None:
                            r.reported = int(health.get("calls") or 0)
                            r.others = max(0, r.reported - r.inflight)
        for ep in [ep for ep in current.endpoints if ep.name not in known]:
            self._bring_up(ep)
        with self.pool.cond:
            self.pool.everyone()

    def _superseded(self, seen: str) -> None:
        """Another ``.to()`` (this process or another) deployed new code: this handle stops
        scaling and routing; its calls fail saying so (``seen``: what showed it)."""
        self._stop.set()
        self.pool.forget(
            f"deployment {self.dep.name!r} was redeployed by another .to() ({seen}; this "
            f"handle's launch is {self.dep.launch_id}); use the new handle, or call .to() again"
        )

    def _bring_up(self, ep: PodEndpoint) -> None:
        """A replica not routed yet: route to it once it runs the current launch (it loads it
        at boot from the launch file; one that has another is sent it)."""
        try:
            health = self.dep.client.ready(ep.url, timeout=1.0)
        except KtliteError:
            return  # not answering yet: next tick
        if health is not None and not self.dep.launch_id and self.pool.launch is None:
            self.dep.launch_id = str(
                health.get("launch_id") or ""
            )  # attached with no replica running
        if health is not None and health.get("launch_id") == self.dep.launch_id:
            with self.pool.cond:
                self.pool.admit(ep, self.dep.launch_id)
            return
        if health is None:
            # booting (loading the launch file) or no code: a launch is sent only to a pod
            # that has none, so a boot that is loading the current launch finishes on its own
            try:
                plain = self.dep.client.health(ep.url, timeout=1.0)
            except KtliteError:
                return
            if plain.get("launch_id") is not None:
                return
        if self.pool.launch is None:
            return
        # the replica installs it only if it holds no newer generation: a newer .to() (another
        # handle, or another process) may have given it newer code, which this must not replace
        launch = self.pool.launch
        try:
            failures, _ = split(
                self.dep.client.deploy(
                    ep.url, launch.encode(), self.dep.spec.pod.calls.launch_timeout + 30
                )
            )
        except StaleLaunch as e:  # this handle's .to() is not the newest any more
            self._superseded(f"replica {ep.name} refused this handle's launch: {e}")
            return
        except KtliteError:  # unreachable, or not ready: the next look tries again
            return
        if not failures:
            with self.pool.cond:
                self.pool.admit(ep, self.dep.launch_id)

    def _scale_to(self, count: int) -> None:
        """Start replicas until ``count`` run (the backend keeps the ones running)."""
        if self._stop.is_set():
            return
        with self.pool.cond:
            for r in self.pool.replicas.values():  # a draining replica is the quickest to get back
                if r.draining and count > len(
                    [x for x in self.pool.replicas.values() if not x.draining]
                ):
                    r.draining = False
        running = len([r for r in self.pool.replicas.values() if not r.draining])
        if count <= running:
            return
        started = time.monotonic()
        applied = require(self.dep.backend, ClientScaling).scale(
            self.dep.name, self.dep.applied.token, count
        )
        self.dep.applied = applied
        self._refresh()
        logger.info(
            "%s: %d -> %d replicas in %.2fs",
            self.dep.name,
            running,
            count,
            time.monotonic() - started,
        )

    def _drain(self, how_many: int) -> None:
        """Mark the ``how_many`` highest replicas draining: they finish their calls, take no
        new ones, and stop once idle (the backend stops the highest ordinals)."""
        with self.pool.cond:
            live = sorted(
                (r for r in self.pool.replicas.values() if not r.draining),
                key=lambda r: r.ep.ordinal,
            )
            for r in live[len(live) - how_many :]:
                r.draining = True

    def _fill_gaps(self) -> None:
        """Replace a replica that died below the highest one that runs (the backend starts
        and stops by ordinal: the highest go first when scaling down)."""
        with self.pool.cond:
            live = sorted(r.ep.ordinal for r in self.pool.replicas.values() if not r.draining)
            if (
                not live
                or live[-1] + 1 == len(live)
                or any(r.draining for r in self.pool.replicas.values())
            ):
                return
        self.dep.applied = require(self.dep.backend, ClientScaling).scale(
            self.dep.name, self.dep.applied.token, live[-1] + 1
        )
        self._refresh()

    def _stop_drained(self) -> None:
        with self.pool.cond:
            draining = [r for r in self.pool.replicas.values() if r.draining]
            if not draining or any(r.inflight or r.reported for r in draining):
                return
            keep = len(self.pool.replicas) - len(draining)
            # the backend stops the ordinals from ``keep`` up: only when those are the drained ones
            if any(r.ep.ordinal >= keep for r in self.pool.replicas.values() if not r.draining):
                return
        applied = require(self.dep.backend, ClientScaling).scale(
            self.dep.name, self.dep.applied.token, keep
        )
        self.dep.applied = applied
        with self.pool.cond:
            for r in draining:
                self.pool.replicas.pop(r.ep.name, None)
