"""The stand-in cluster as the Kubernetes backend's unit tests drive it: the fake API server
(``kube_fake``) in-process as an httpx transport on a fake clock, and a ``KubernetesBackend``
over it whose sleeps advance that clock; its requests about pods counted by kind."""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

import httpx
import kube_fake as kf

from ktlite.backends.kube_api import ClusterInfo
from ktlite.backends.kubernetes import KubernetesBackend

HOST = "https://fake-apiserver"
API_TOKEN = "api-bearer-stand-in"
PODS = "/api/v1/namespaces/default/pods"


class Cluster:
    """A stand-in API server and a backend over it (``close()`` the client after)."""

    def __init__(self, behavior: kf.PodBehavior | None = None, **options: Any) -> None:
        self.clock = kf.FakeClock()
        self.fake = kf.FakeKube(token=API_TOKEN, pod_behavior=behavior, clock=self.clock, **options)
        self.http = httpx.Client(
            transport=self.fake, base_url=HOST, headers={"authorization": f"Bearer {API_TOKEN}"}
        )
        self.backend = KubernetesBackend(
            self.http,
            ClusterInfo(HOST, "fake-ctx", "default", False),
            out=io.StringIO(),
            clock=self.clock,
            sleep=self.clock.advance,
        )

    def close(self) -> None:
        self.http.close()

    def requests(self, since: int = 0) -> Counter[str]:
        """Requests about pods since ``since``, by kind: ``LIST``, ``WATCH``, ``DELETE pod``,
        ``DELETECOLLECTION``, ``proxy`` (to a pod), ``log`` (a pod's), ``GET pod``."""
        kinds: Counter[str] = Counter()
        for r in self.fake.requests[since:]:
            if not r.path.startswith(PODS):
                continue
            if "/proxy" in r.path:
                kinds["proxy"] += 1
            elif r.path.endswith("/log"):
                kinds["log"] += 1
            elif r.path == PODS:
                watch = r.query.get("watch") == "true"
                verb = {"GET": "WATCH" if watch else "LIST", "DELETE": "DELETECOLLECTION"}
                kinds[verb.get(r.method, r.method)] += 1
            else:
                kinds[f"{r.method} pod"] += 1
        return kinds
