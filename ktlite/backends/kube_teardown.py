"""Removing a Kubernetes deployment: its objects by name, its pods (and with ``volumes`` its
claims) as one collection each (one request at any pod count), then a watch until they are
gone; and removing what a failed first deploy had made.

Mixed into :class:`~ktlite.backends.kubernetes.KubernetesBackend`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from ktlite.backends import kube_expiry as kexp
from ktlite.backends import kube_manifests as km
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.backends.kube_watch import PodWatch
from ktlite.errors import DeployError

if TYPE_CHECKING:
    from ktlite.backends.kube_host import KubeHost as _Base
else:
    _Base = object

logger = logging.getLogger(__name__)


def delete_pods(api: KubeApi, selector: str) -> int:
    """Delete the pods ``selector`` matches (``delete_all``); how many there were."""
    return delete_all(api, "Pod", selector)


def delete_all(api: KubeApi, kind: str, selector: str) -> int:
    """Delete the ``kind`` objects ``selector`` matches: one ``deletecollection``, or, for an
    account without that verb, a LIST and one DELETE each. How many there were."""
    try:
        return api.delete_collection(kind, selector)
    except KubeApiError as e:
        if e.status != 403:
            raise
        logger.info("may not deletecollection %ss (%s); deleting them one by one", kind, e)
    objs = api.list(kind, selector)
    for obj in objs:
        api.delete(kind, obj["metadata"]["name"])
    return len(objs)


class Teardown(_Base):
    """How the Kubernetes backend removes deployments (mixed into it)."""

    def teardown(self, name: str, timeout: float = 30.0, volumes: bool = False) -> bool:
        api = self._api()
        found = False
        for sts in api.list("StatefulSet", km.selector(name)):
            found |= api.delete("StatefulSet", sts["metadata"]["name"])
        found |= api.delete("StatefulSet", name)  # one an older ktlite made without the label
        found |= api.delete("Service", name)
        found |= api.delete("Secret", km.token_secret_name(name))
        for obj in api.list("Secret", km.selector(name)):  # the user's values (kt.secret / presets)
            if km.SECRET_LABEL in (obj["metadata"].get("labels") or {}):
                found |= api.delete("Secret", obj["metadata"]["name"])
        found |= self._drop_policy(api, name) | kexp.drop_access(api, name)
        found |= self._teardown_served(api, name)
        found |= delete_pods(api, km.selector(name)) > 0
        if volumes:  # the claims, as one collection too
            found |= delete_all(api, "PersistentVolumeClaim", km.selector(name)) > 0
        return self._watch_pods_gone(api, name, timeout) or found

    def _watch_pods_gone(self, api: KubeApi, name: str, timeout: float) -> bool:
        """Follow the deployment's pods until none is left; True if any was there."""
        deadline = self._clock() + timeout
        watch = PodWatch(api, km.selector(name), self._clock, self._sleep)
        watch.list_now()
        if not watch.pods:  # none left (or none ever): no watch, which would wait its window out
            return False
        seen = True
        while True:
            with contextlib.closing(watch.changes(deadline)) as changes:
                for _ in changes:
                    seen |= bool(watch.pods)
                    if not watch.pods:
                        break
            if not watch.pods and watch.lists:
                return seen
            if self._clock() >= deadline:
                names = sorted(watch.pods)
                shown = ", ".join(names[:10]) + (
                    f" and {len(names) - 10} more" if len(names) > 10 else ""
                )
                raise DeployError(
                    f"teardown of {name!r}: pod(s) {shown} were still terminating after "
                    f"{timeout:g}s; they will go on their own, or check "
                    f"`kubectl -n {api.namespace} get pods -l {km.selector(name)}`"
                )

    def _remove(self, api: KubeApi, name: str, created: list[tuple[str, str]]) -> None:
        for kind, obj in reversed(created):  # the StatefulSet (and so its pods) first
            api.delete(kind, obj)
        delete_pods(api, km.selector(name))

    def _drop_policy(self, api: KubeApi, name: str) -> bool:
        """Delete the deployment's NetworkPolicy, if any. Without the right to manage policies
        it has none: ktlite could not have made one."""
        try:
            return api.delete("NetworkPolicy", name)
        except KubeApiError as e:
            if e.status in (403, 404):  # forbidden, or the API group is not served
                return False
            raise
