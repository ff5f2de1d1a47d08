"""Waiting for a Kubernetes deployment's pods: ready means each runs its StatefulSet's
template and its server answers; a pod that cannot start fails the wait early, with why."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends import kube_tls
from ktlite.backends.kube_api import KubeApi
from ktlite.backends.kube_diagnose import PodProblem, diagnose, progress
from ktlite.errors import LaunchTimeout
from ktlite.specs.deployment_spec import DeploymentSpec

if TYPE_CHECKING:
    from ktlite.backends.kube_host import KubeHost as _Base
else:
    _Base = object

POLL_S = 1.0


class PodReadiness(_Base):
    """How the Kubernetes backend waits for pods (mixed into it)."""

    def wait_ready(
        self, api: KubeApi, spec: DeploymentSpec, want: dict[int, str]
    ) -> list[dict[str, Any]]:
        """Pods 0..N-1, each running its StatefulSet's template (``want``: ordinal → pod hash)
        and answering; fails early with the reason a pod cannot start, and after
        ``launch_timeout`` with the last reason seen.

        A pod counts as soon as its server answers /health, which we ask ourselves: waiting
        for the kubelet's readiness probe (and then for the next poll) would round every
        cold start up by a second or two. Polls start fast and slow down as the wait goes on."""
        n = spec.workers
        timeout = spec.pod.calls.launch_timeout
        start = self._clock()
        deadline = start + timeout
        last_line, last_reason = "", "no pod was created yet"
        answering: set[str] = set()  # uids of pods whose server answered
        while True:
            pods = {
                kp.ordinal(p): p
                for p in api.list("Pod", km.selector(spec.name))
                if kp.pod_hash(p) == want.get(kp.ordinal(p))
                and not p["metadata"].get("deletionTimestamp")
            }
            current = [pods[i] for i in range(n) if i in pods]
            line = progress(current, n)
            if line != last_line:
                self._say(f"{spec.name}: {line}")
                last_line = line
            if len(current) == n and all(self._serving(api, p, answering) for p in current):
                return current
            for pod in current:
                problem = diagnose(
                    pod,
                    scaling_up=lambda p: self._scaling_up(api, p),
                    claims=lambda p: self._claims_problem(api, p),
                )
                if problem is None:
                    continue
                if problem.fatal:
                    raise kp.deploy_error(problem, self._explain(api, spec, problem))
                last_reason = problem.message
            now = self._clock()
            if now > deadline:
                raise LaunchTimeout(
                    f"deployment {spec.name!r} was not ready after launch_timeout={timeout:g}s: {line}; "
                    f"last reason: {last_reason}. Raise launch_timeout, or look at "
                    f"`kubectl -n {api.namespace} describe pod {spec.name}-0`"
                )
            self._sleep(min(POLL_S, 0.1 + (now - start) / 20))

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
