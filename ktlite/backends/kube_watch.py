"""A deployment's pods as the API server has them, kept current by one LIST and then WATCH.

The list gives the pods and a ``resourceVersion``; each watch after it asks for the changes
since the last version seen (a bookmark moves it on too), for a bounded window the API server
closes. A watch that expired (410 Gone), broke, or said nothing for longer than its window
(client libraries' watches are known to stall silently) is replaced by a fresh LIST; so is
any watch after ``relist_s`` without one, in case one missed a change. Where the account may
not watch pods (403), the pods are listed every ``poll_s`` instead, as before watches.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Generator, Iterator
from typing import Any

from ktlite.backends.kube_api import KubeApi, KubeApiError

logger = logging.getLogger(__name__)

WINDOW_S = 60.0  # the longest watch asked for: the API server closes it then
STALL_S = 15.0  # silence past a watch's window before it counts as stalled
RELIST_S = 300.0  # a fresh LIST at least this often
POLL_S = 1.0  # the LIST interval where watching is not allowed


class PodWatch:
    """The pods ``selector`` matches, by name (``pods``), and which of them change."""

    def __init__(
        self,
        api: KubeApi,
        selector: str,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        *,
        relist_s: float = RELIST_S,
        stall_s: float = STALL_S,
    ) -> None:
        self.api, self.selector = api, selector
        self._clock, self._sleep = clock, sleep
        self.pods: dict[str, dict[str, Any]] = {}
        self._version = ""  # empty: the next change is a LIST
        self._listed_at = -math.inf
        self._relist_s, self._stall_s = relist_s, stall_s
        self._polling = False  # this account may not watch pods
        self.lists = self.watches = 0  # requests made, for messages and tests

    def changes(self, until: float) -> Generator[str, None, None]:
        """The names of the pods that changed (or went), as the changes arrive, until the
        clock passes ``until``; the first call names every pod the LIST found. Close the
        iterator (``contextlib.closing``) when leaving it early: it holds a watch open."""
        if not self._version or self._clock() - self._listed_at >= self._relist_s:
            yield from self._relist()
        if self._polling or not self._version:  # no watch (or a list without a version)
            self._sleep(max(0.0, min(POLL_S, until - self._clock())))
            self._version = ""
            return
        window = min(WINDOW_S, until - self._clock())
        if window <= 0:
            return
        self.watches += 1
        ends = self._clock() + window
        try:
            with self.api.watch(
                "Pod",
                self.selector,
                self._version,
                timeout_s=max(1, math.ceil(window)),
                stall_s=window + self._stall_s,
            ) as events:
                for event in events:
                    name = self._apply(event)
                    if name is not None:
                        yield name
                    if self._clock() >= until:
                        return
            if self._clock() < ends - 1.0:  # closed early: dropped, not timed out
                logger.info("the pod watch of %s closed early; listing again", self.selector)
                self._sleep(max(0.0, min(POLL_S, until - self._clock())))
                self._version = ""
        except KubeApiError as e:
            if e.status in (403, 405):  # may not watch: list instead, from now on
                logger.info("watching pods %s is not allowed (%s); listing them", self.selector, e)
                self._polling = True
            elif e.status == 410:
                logger.debug("the pod watch expired at version %s; listing again", self._version)
            else:
                logger.info("the pod watch of %s ended: %s; listing again", self.selector, e)
            self._version = ""

    def _apply(self, event: dict[str, Any]) -> str | None:
        """Take one event in; the name of the pod it changed (None: a bookmark)."""
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        self._version = str(meta.get("resourceVersion") or self._version)
        kind = event.get("type")
        if kind == "BOOKMARK":
            return None
        name: str = meta["name"]
        if kind == "DELETED":
            held = self.pods.get(name)
            # the StatefulSet may have made its successor (another uid) already
            if held is not None and held["metadata"].get("uid") == meta.get("uid"):
                del self.pods[name]
        else:  # ADDED, MODIFIED
            self.pods[name] = obj
        return name

    def list_now(self) -> None:
        """LIST the pods now (``pods`` holds them); a following :meth:`changes` watches from
        this list's version."""
        for _ in self._relist():
            pass

    def _relist(self) -> Iterator[str]:
        items, version = self.api.list_at("Pod", self.selector)
        self.lists += 1
        now = {p["metadata"]["name"]: p for p in items}
        gone = [name for name in self.pods if name not in now]
        changed = [
            name
            for name, pod in now.items()
            if (self.pods.get(name) or {}).get("metadata", {}).get("resourceVersion")
            != pod["metadata"].get("resourceVersion")
        ]
        self.pods, self._version, self._listed_at = now, version, self._clock()
        yield from gone
        yield from changed
