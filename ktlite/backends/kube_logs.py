"""A Kubernetes deployment's pod logs: all pods' or one's, their tails, or followed live.

The Kubernetes log API is per pod (``pods/NAME/log``; the kubelet of each pod's node serves
it): reading every pod's log costs one LIST and one request per pod, whatever ktlite does (a
pod server cannot read another container's log). They are read ``READERS`` at a time and
printed in ordinal order as they arrive; following keeps one stream per pod open, at most
``FOLLOW_MAX`` (the API client's connection pool, less room for other requests).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_pods as kp
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.errors import DeployError

READERS = 16  # pod logs read at once
FOLLOW_MAX = 48  # pods followed at once: the API client holds 64 connections


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
        if len(pods) > FOLLOW_MAX:
            raise DeployError(
                f"following the logs of {len(pods)} pods of {name!r} at once would hold "
                f"{len(pods)} streams to the API server (its log API is per pod); at most "
                f"{FOLLOW_MAX}: follow one pod (--pod I / ordinal=I), or read the tails "
                "without following"
            )
        if len(pods) > 1:
            yield from _merge_follow(api, [p["metadata"]["name"] for p in pods], tail)
        else:
            pod_name = pods[0]["metadata"]["name"]
            yield from (f"[{pod_name}] {line}" for line in api.follow_log(pod_name, tail))
        return
    names = [p["metadata"]["name"] for p in pods]
    reads = [functools.partial(api.pod_log, n, tail=tail) for n in names]
    for pod_name, text in zip(names, _in_order(reads), strict=True):
        for line in text.splitlines():
            yield f"[{pod_name}] {line}"


def _in_order(reads: Sequence[Callable[[], str]]) -> Iterator[str]:
    """Each read's text in order, ``READERS`` in flight at most (and so at most ``READERS``
    texts held before they are printed); a consumer that stops early cancels the rest."""
    if len(reads) == 1:
        yield reads[0]()
        return
    readers = concurrent.futures.ThreadPoolExecutor(min(READERS, len(reads)), "ktlite-logs")
    pending: collections.deque[concurrent.futures.Future[str]] = collections.deque()
    try:
        for read in reads:
            pending.append(readers.submit(read))
            if len(pending) == READERS:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        readers.shutdown(wait=False, cancel_futures=True)


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
