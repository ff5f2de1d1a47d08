"""A Kubernetes deployment's pod logs: all pods' or one's, their tails, or followed live."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.errors import DeployError


def pod_logs(
    api: KubeApi,
    name: str,
    ordinal: int | None = None,
    follow: bool = False,
    tail: int | None = None,
) -> Iterator[str]:
    pods = sorted(api.list("Pod", km.selector(name)), key=kp.ordinal)
    if ordinal is not None:
        pods = [p for p in pods if kp.ordinal(p) == ordinal]
    if not pods:
        which = f"pod {ordinal} of " if ordinal is not None else ""
        raise DeployError(f"no {which}deployment {name!r} in namespace {api.namespace!r}")
    if follow:
        if len(pods) > 1:
            yield from _merge_follow(api, [p["metadata"]["name"] for p in pods], tail)
        else:
            pod_name = pods[0]["metadata"]["name"]
            yield from (f"[{pod_name}] {line}" for line in api.follow_log(pod_name, tail))
        return
    for pod in pods:
        pod_name = pod["metadata"]["name"]
        for line in api.pod_log(pod_name, tail=tail).splitlines():
            yield f"[{pod_name}] {line}"


def _merge_follow(api: KubeApi, pods: list[str], tail: int | None) -> Iterator[str]:
    """Follow several pods' logs at once (one reader thread each), lines as they come."""
    import queue

    lines: queue.Queue[str | None] = queue.Queue()

    def read(pod: str) -> None:
        try:
            for line in api.follow_log(pod, tail):
                lines.put(f"[{pod}] {line}")
        except KubeApiError as e:
            lines.put(f"[{pod}] ktlite: {e}")
        finally:
            lines.put(None)

    for pod in pods:
        threading.Thread(target=read, args=(pod,), daemon=True).start()
    open_streams = len(pods)
    while open_streams:
        item = lines.get()
        if item is None:
            open_streams -= 1
        else:
            yield item
