"""Followed pod logs (``follow=true``) of the fake API server (``kube_fake.FakeKube``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

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
