"""Pod logs of the fake API server (``kube_fake.FakeKube``): the kubelet's rules for which
container's log a request gets, ``tailLines``/``limitBytes``/``previous``, and ``follow=true``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from kube_fake_api import _bad

if TYPE_CHECKING:
    from kube_fake import FakeKube


@dataclass
class LogKey:
    ns: str
    pod: str
    container: str
    uid: str
    offset: int = 0


class FollowStream(httpx.SyncByteStream):
    """``follow=true``: what is there, then appended text until the pod or its container goes,
    or nothing new came for ``follow_idle_timeout`` seconds."""

    def __init__(self, fake: FakeKube, key: LogKey, first: str) -> None:
        self.fake, self.key, self.first = fake, key, first

    def __iter__(self) -> Iterator[bytes]:
        if self.first:
            yield self.first.encode()
        key, fake = self.key, self.fake
        idle_until = time.monotonic() + fake.follow_idle_timeout
        while time.monotonic() < idle_until:
            time.sleep(0.01)
            with fake.lock:
                fake._tick()
                pod = fake._store.get(("pods", key.ns, key.pod))
                alive = pod is not None and pod["metadata"]["uid"] == key.uid
                text = fake._log_text(key.ns, key.pod, key.container, False) if alive else ""
                running = alive and any(
                    s["name"] == key.container and "running" in s["state"]
                    for s in pod["status"].get("containerStatuses", [])
                )
            if len(text) > key.offset:
                yield text[key.offset :].encode()
                key.offset = len(text)
                idle_until = time.monotonic() + fake.follow_idle_timeout
            if not running:
                return


class Logs:
    """Mixed into ``kube_fake.FakeKube``."""

    def _log_text(self, ns: str, pod: str, container: str, previous: bool) -> str:
        text = self._logs.get((ns, pod, container, previous))
        return self._logs.get((ns, pod, None, previous), "") if text is None else text

    def _log(self, ns: str, name: str, query: dict[str, str]) -> httpx.Response:
        pod = self._get("pods", ns, name)
        names = [c["name"] for c in pod["spec"]["containers"]]
        container = query.get("container")
        if container is None and len(names) != 1:
            raise _bad(
                f"a container name must be specified for pod {name}, choose one of: "
                f"[{' '.join(names)}]"
            )
        container = container or names[0]
        if container not in names:
            raise _bad(f"container {container} is not valid for pod {name}")
        if not pod["spec"].get("nodeName"):
            return httpx.Response(200, text="", headers={"content-type": "text/plain"})
        statuses = pod["status"].get("containerStatuses") or []
        cs = next((s for s in statuses if s["name"] == container), {})
        state, last = cs.get("state", {}), cs.get("lastState", {})
        where = f'container "{container}" in pod "{name}"'
        if query.get("previous") in ("true", "1"):
            if "terminated" not in last:
                raise _bad(f"previous terminated {where} not found")
            previous = True
        elif "running" in state or "terminated" in state:
            previous = False
        elif "terminated" in last:
            previous = True  # in back-off: the kubelet serves the last run's log
        elif "waiting" in state:
            reason = state["waiting"].get("reason", "")
            raise _bad(
                f"{where} is waiting to start: "
                + {
                    "ErrImagePull": "image can't be pulled",
                    "ImagePullBackOff": "trying and failing to pull image",
                }.get(reason, reason)
            )
        else:
            raise _bad(f"{where} is waiting to start - no logs yet")
        full = self._log_text(ns, name, container, previous)
        text = full
        if "tailLines" in query:
            n = int(query["tailLines"])
            text = "".join(text.splitlines(keepends=True)[-n:]) if n > 0 else ""
        if "limitBytes" in query:
            text = text.encode()[: int(query["limitBytes"])].decode(errors="ignore")
        headers = {"content-type": "text/plain"}
        if query.get("follow") in ("true", "1") and "running" in state and not previous:
            key = LogKey(ns, name, container, pod["metadata"]["uid"], len(full))
            return httpx.Response(200, headers=headers, stream=FollowStream(self, key, text))
        return httpx.Response(200, text=text, headers=headers)
