"""A deployment's StatefulSets as the Kubernetes backend applies them: create, update in place
(or replace where an immutable field differs), scale, and restart exactly the pods whose
template is out of date; remove the parts a new shape has no place for.

Mixed into :class:`~ktlite.backends.kubernetes.KubernetesBackend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.backends.kube_readiness import POLL_S
from ktlite.backends.kube_teardown import delete_pods
from ktlite.errors import DeployError

if TYPE_CHECKING:
    from ktlite.backends.kube_host import KubeHost as _Base
else:
    _Base = object


class StatefulSets(_Base):
    """How the Kubernetes backend applies StatefulSets (mixed into it)."""

    def _apply_statefulset(self, api: KubeApi, sts: dict[str, Any], roll_all: bool) -> list[int]:
        """Create or update one StatefulSet; delete its pods whose template is out of date (the
        controller re-creates them). Returns the ordinals that get new pods."""
        name = sts["metadata"]["name"]
        start, replicas = kp.first_ordinal(sts), sts["spec"]["replicas"]
        ordinals = range(start, start + replicas)
        current = api.get("StatefulSet", name)
        if current is None:
            api.create(sts)
            return list(ordinals)
        want = kp.pod_hash(sts["spec"]["template"])
        old_replicas = current["spec"].get("replicas", 0)
        if kp.pod_hash(current["spec"]["template"]) != want:
            try:
                api.replace(sts, current["metadata"]["resourceVersion"])
            except KubeApiError as e:
                # an immutable field differs (an older ktlite made it, or its selector)
                if e.status != 422:
                    raise
                api.delete("StatefulSet", name, propagation="Foreground")
                self._wait_gone(api, "StatefulSet", name, 60.0)
                api.create(sts)
                return list(ordinals)
        elif old_replicas != replicas:
            api.patch("StatefulSet", name, {"spec": {"replicas": replicas}})
        # new ordinals of a scale-up
        restarted = list(range(start + old_replicas, start + replicas))
        pods = api.list("Pod", kp.match(sts))
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        stale = [
            p for p in live if kp.ordinal(p) in ordinals and (roll_all or kp.pod_hash(p) != want)
        ]
        if len(stale) > 1 and len(stale) == len(live):  # all of them: one request at any count
            delete_pods(api, kp.match(sts))
        else:
            for pod in stale:
                api.delete("Pod", pod["metadata"]["name"])
        present = {kp.ordinal(p) for p in pods}
        restarted += [kp.ordinal(p) for p in stale] + [i for i in ordinals if i not in present]
        return sorted(set(restarted))

    def _remove_stale_parts(self, api: KubeApi, name: str, keep: set[str]) -> None:
        """Delete this deployment's StatefulSets that the new shape has no place for (pods of
        other sizes); their pods go with them. Before the others are applied, so no two
        StatefulSets ever claim a pod."""
        for sts in api.list("StatefulSet", km.selector(name)):
            if sts["metadata"]["name"] not in keep:
                api.delete("StatefulSet", sts["metadata"]["name"], propagation="Foreground")
                self._wait_gone(api, "StatefulSet", sts["metadata"]["name"], 60.0)

    def _wait_gone(self, api: KubeApi, kind: str, name: str, timeout: float) -> None:
        deadline = self._clock() + timeout
        while api.get(kind, name) is not None:
            if self._clock() > deadline:
                raise DeployError(f"{kind} {name} was still being deleted after {timeout:g}s")
            self._sleep(POLL_S)
