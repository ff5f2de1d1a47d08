"""The stand-in cluster as the Kubernetes backend's unit tests drive it: the fake API server
(``kube_fake``) in-process as an httpx transport on a fake clock, a client for it, and a
``KubernetesBackend`` over both whose sleeps advance that clock. Test modules subclass
:class:`Cluster` for what only they ask of it."""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

import httpx
import kube_fake as kf

from ktlite.backends import kube_deps
from ktlite.backends.kube_api import ClusterInfo
from ktlite.backends.kubernetes import KubernetesBackend

HOST = "https://fake-apiserver"
API_TOKEN = "api-bearer-stand-in"
PODS = "/api/v1/namespaces/default/pods"


class Cluster:
    """A stand-in API server, a client for it and a backend wired to both and to a fake clock
    (``close()`` the client after). ``api_token``: the bearer token the fake accepts."""

    api_token = API_TOKEN
    context = "fake-ctx"

    def __init__(
        self,
        behavior: kf.PodBehavior | None = None,
        *,
        namespace: str = "default",
        in_cluster: bool = False,
        **fake_options: Any,
    ) -> None:
        self.clock = kf.FakeClock()
        self.fake = kf.FakeKube(
            token=self.api_token, pod_behavior=behavior, clock=self.clock, **fake_options
        )
        self.http = httpx.Client(
            transport=self.fake,
            base_url=HOST,
            headers={"authorization": f"Bearer {self.api_token}"},
        )
        self.out = io.StringIO()
        self.info = ClusterInfo(HOST, self.context, namespace, in_cluster)
        self.backend = self.new_backend()

    def new_backend(self, **options: Any) -> KubernetesBackend:
        """Another backend over the same client and clock (its progress lines in ``out``)."""
        return KubernetesBackend(
            self.http,
            self.info,
            out=self.out,
            clock=self.clock,
            sleep=self.clock.advance,
            **options,
        )

    def close(self) -> None:
        self.http.close()

    def names(self, kind: str) -> list[str]:
        """The names of ``kind`` there, but the namespace's shared cache of the server's
        packages (``kube_deps``: no deployment's own)."""
        return [
            o["metadata"]["name"]
            for o in self.fake.objects(kind)
            if kube_deps.DEPS_LABEL not in (o["metadata"].get("labels") or {})
        ]

    def writes(self, since: int = 0) -> list[tuple[str, str]]:
        """The requests since ``since`` that change something: (method, path)."""
        return [(r.method, r.path) for r in self.fake.requests[since:] if r.method != "GET"]

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
