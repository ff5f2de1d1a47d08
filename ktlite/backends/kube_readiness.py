"""Waiting for a Kubernetes deployment's pods: ready means each runs its StatefulSet's
template and its readiness probe passes (the kubelet asks its server's /health); a pod that
cannot start fails the wait early, with why.

The wait follows the pods with one LIST and then WATCH (``kube_watch``): its API requests do
not grow with the pod count, and it asks no pod anything itself (the code push that follows
is the first to reach a pod)."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import httpx

from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends import kube_tls
from ktlite.backends.kube_api import KubeApi
from ktlite.backends.kube_diagnose import PodProblem, diagnose
from ktlite.backends.kube_tally import PodTally
from ktlite.backends.kube_watch import PodWatch
from ktlite.errors import LaunchTimeout
from ktlite.specs.deployment_spec import DeploymentSpec

if TYPE_CHECKING:
    from ktlite.backends.kube_host import KubeHost as _Base
else:
    _Base = object

POLL_S = 1.0
CHECK_S = 2.0  # how often a reason that other objects decide (autoscaler, volumes) is re-read
LOOKUP_S = 1.0  # how long one reading of those objects serves every pod that asks
PROGRESS_S = 1.0  # the least time between two progress lines


class PodReadiness(_Base):
    """How the Kubernetes backend waits for pods (mixed into it)."""

    def wait_ready(
        self, api: KubeApi, spec: DeploymentSpec, want: dict[int, str]
    ) -> list[dict[str, Any]]:
        """Pods 0..N-1, each running its StatefulSet's template (``want``: ordinal → pod hash)
        and Ready; fails early with the reason a pod cannot start, and after
        ``launch_timeout`` naming the pods that are not Ready and why."""
        timeout = spec.pod.calls.launch_timeout
        start = self._clock()
        deadline = start + timeout
        watch = PodWatch(api, km.selector(spec.name), self._clock, self._sleep)
        tally = PodTally(spec.workers, want)
        lookups = _Lookups(self, api)
        show = _Progress(self, spec.name)
        recheck: set[str] = set()  # pods whose reason other objects decide
        next_check = start + CHECK_S
        while True:
            until = min(deadline, next_check) if recheck else deadline
            with contextlib.closing(watch.changes(until)) as names:
                for name in names:
                    show.before_change(tally.line())
                    pod = tally.update(name, watch.pods.get(name))
                    if tally.done():
                        show.final(tally.line())
                        return tally.pods()
                    recheck.discard(name)
                    if pod is not None and not kp.is_ready(pod):
                        self._check(api, spec, pod, lookups, recheck)
            show.flush(tally.line())
            now = self._clock()
            if recheck and now >= next_check:
                for name in sorted(recheck):
                    recheck.discard(name)
                    pod = tally.pod(name)
                    if pod is not None:
                        self._check(api, spec, pod, lookups, recheck)
                next_check = now + CHECK_S
            if now >= deadline:
                show.final(tally.line())
                raise LaunchTimeout(
                    f"deployment {spec.name!r} was not ready after launch_timeout={timeout:g}s: "
                    f"{tally.line()}; {self._not_ready(tally, lookups)}. Raise launch_timeout, "
                    f"or look at `kubectl -n {api.namespace} describe pod "
                    f"{tally.first_not_ready(spec.name)}`"
                )

    def _check(
        self,
        api: KubeApi,
        spec: DeploymentSpec,
        pod: dict[str, Any],
        lookups: _Lookups,
        recheck: set[str],
    ) -> None:
        """Fail the wait if ``pod`` cannot start; note it for a later look if its reason is
        one that other objects decide (the autoscaler's events, its volumes)."""
        problem = diagnose(pod, scaling_up=lookups.scaling_up, claims=lookups.claims)
        if problem is None:
            return
        if problem.fatal:
            raise kp.deploy_error(problem, self._explain(api, spec, problem))
        scheduled: dict[str, Any] = next(
            (
                c
                for c in (pod.get("status") or {}).get("conditions") or []
                if c.get("type") == "PodScheduled"
            ),
            {},
        )
        if scheduled.get("reason") == "Unschedulable":
            recheck.add(pod["metadata"]["name"])

    def _not_ready(self, tally: PodTally, lookups: _Lookups, shown: int = 5) -> str:
        """``"not Ready: job-3 (reason), job-7 (no pod yet) and 12 more"``."""
        parts = []
        missing = tally.not_ready()
        for ordinal, pod in missing[:shown]:
            if pod is None:
                parts.append(f"pod {ordinal} (not created yet, or still the old template's)")
                continue
            problem = diagnose(pod, scaling_up=lookups.scaling_up, claims=lookups.claims)
            reason = problem.message if problem is not None else "not Ready yet"
            parts.append(f"{pod['metadata']['name']} ({reason})")
        more = f" and {len(missing) - shown} more" if len(missing) > shown else ""
        return "not Ready: " + ", ".join(parts) + more

    def _serving(self, api: KubeApi, pod: dict[str, Any], answering: set[str]) -> bool:
        """Ready, or its server already answers /health (asked once it runs)."""
        uid = pod["metadata"].get("uid", "")
        if kp.is_ready(pod) or uid in answering:
            return True
        status = pod.get("status") or {}
        running = any(
            "running" in (c.get("state") or {}) for c in status.get("containerStatuses") or []
        )
        if status.get("phase") != "Running" or not status.get("podIP") or not running:
            return False
        http, info = self._connect()
        secure = kube_tls.serves_tls(pod)
        try:
            if info.in_cluster:  # straight to the pod, without the API credentials
                # only whether it answers: nothing is sent, so nothing to pin (as the kubelet)
                ok = (
                    httpx.get(
                        f"{kp.url(status['podIP'], km.SERVER_PORT, https=secure)}/health",
                        timeout=2.0,
                        verify=False,
                    ).status_code
                    == 200
                )
            else:
                url = api.proxy_url(pod["metadata"]["name"], km.SERVER_PORT, https=secure)
                ok = http.get(f"{url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            answering.add(uid)
        return ok

    def _scaled_up(self, api: KubeApi) -> set[str]:
        """The pods the cluster autoscaler is adding a node for (one request for them all)."""
        events = api.list("Event", field_selector="reason=TriggeredScaleUp")
        return {(e.get("involvedObject") or {}).get("name", "") for e in events}

    def _scaling_up(self, api: KubeApi, pod: dict[str, Any]) -> bool:
        """True if the cluster autoscaler is adding a node for this unschedulable pod."""
        events = api.list("Event", field_selector=f"involvedObject.name={pod['metadata']['name']}")
        return any(e.get("reason") == "TriggeredScaleUp" for e in events)

    def _claims_problem(self, api: KubeApi, pod: dict[str, Any]) -> str | None:
        """Why a claim ``pod`` mounts will not bind, or None while it may still: a missing
        claim, or one the provisioner failed (no such StorageClass, an access mode it cannot
        give) or that no volume can match and no StorageClass would provision."""
        for volume in pod["spec"].get("volumes") or []:
            name = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if not name:
                continue
            claim = api.get("PersistentVolumeClaim", name)
            if claim is None:
                return f"PersistentVolumeClaim {name!r} does not exist"
            if (claim.get("status") or {}).get("phase") == "Bound":
                continue
            events = api.list(
                "Event",
                field_selector=f"involvedObject.name={name},"
                "involvedObject.kind=PersistentVolumeClaim",
            )
            for event in sorted(events, key=lambda e: e.get("lastTimestamp") or "", reverse=True):
                reason, message = event.get("reason", ""), event.get("message", "")
                if reason == "ProvisioningFailed" or (
                    reason == "FailedBinding" and "no storage class is set" in message
                ):
                    return f"PersistentVolumeClaim {name!r}: {reason}: {message}"
        return None

    def _explain(self, api: KubeApi, spec: DeploymentSpec, problem: PodProblem) -> str:
        text = f"deployment {spec.name!r} cannot start: pod {problem.pod}: {problem.message}"
        if problem.want_logs:
            # the container that failed may be the previous one (restarted since) or the current
            # one (its predecessor's log may be gone): show each log that has text, oldest first
            previous = api.pod_log(problem.pod, tail=30, previous=True)
            current = api.pod_log(problem.pod, tail=30)
            if previous.strip() and current.strip() and previous != current:
                shown = [
                    ("the previous container's log", previous),
                    ("the current container's log", current),
                ]
            else:  # one log, or the same one twice (in back-off "current" is the last run's)
                shown = [("its log", log) for log in (previous, current) if log.strip()][:1]
            for label, log in shown:
                text += f"\nlast lines of {label}:\n" + "\n".join(
                    "    " + ln for ln in log.splitlines()
                )
        return text + (f"\n{problem.fix}" if problem.fix else "")


class _Lookups:
    """What the autoscaler and the volume provisioner say, read at most once per
    ``LOOKUP_S`` however many pods ask: one LIST of the scale-up events; each claim once."""

    def __init__(self, backend: PodReadiness, api: KubeApi) -> None:
        self.backend, self.api = backend, api
        self._scaled: tuple[float, set[str]] | None = None
        self._claims: dict[str, tuple[float, str | None]] = {}

    def _fresh(self, at: float) -> bool:
        return self.backend._clock() < at + LOOKUP_S

    def scaling_up(self, pod: dict[str, Any]) -> bool:
        if self._scaled is None or not self._fresh(self._scaled[0]):
            self._scaled = (self.backend._clock(), self.backend._scaled_up(self.api))
        return pod["metadata"]["name"] in self._scaled[1]

    def claims(self, pod: dict[str, Any]) -> str | None:
        names = sorted(
            (v.get("persistentVolumeClaim") or {}).get("claimName", "")
            for v in pod["spec"].get("volumes") or []
        )
        key = ",".join(n for n in names if n)
        held = self._claims.get(key)
        if held is None or not self._fresh(held[0]):
            held = (self.backend._clock(), self.backend._claims_problem(self.api, pod))
            self._claims[key] = held
        return held[1]


class _Progress:
    """The progress line: the state of one instant, said when the next change comes at a
    later time (so one instant's changes are one line) or a watch ends without one, if it
    changed, at most once per ``PROGRESS_S``; and the last state at the end."""

    def __init__(self, backend: PodReadiness, name: str) -> None:
        self.backend, self.name = backend, name
        self.shown, self.shown_at, self.stamp = "", -math.inf, -math.inf

    def before_change(self, line: str) -> None:
        """Before a change is taken in; ``line`` is the state before it (none before the
        first change: that is no state the cluster was in)."""
        now = self.backend._clock()
        if now > self.stamp > -math.inf:
            self.flush(line)
        self.stamp = now

    def flush(self, line: str) -> None:
        now = self.backend._clock()
        if self.stamp > -math.inf and line != self.shown and now >= self.shown_at + PROGRESS_S:
            self._say(line, now)

    def final(self, line: str) -> None:
        if line != self.shown:
            self._say(line, self.backend._clock())

    def _say(self, line: str, now: float) -> None:
        self.backend._say(f"{self.name}: {line}")
        self.shown, self.shown_at = line, now
