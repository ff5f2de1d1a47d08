"""Per-pod Kubernetes API requests outside the call path (issue 26, item 3), against the
stand-in API server on a fake clock: LIST paging (``limit``/``continue``, exercised by a
stand-in that answers small pages), teardown's claims as one collection, the logs of every
pod (the log API is per pod) read a bounded number at a time, and status, restart_failed and
a colocation push as one proxied request at any pod count. Counts are asserted, never times."""

from __future__ import annotations

import platform
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import cloudpickle
import httpx
import kube_fake as kf
import pytest
from kube_cluster import Cluster
from kube_unit import isolate_backend

import ktlite as kt
from ktlite.backends import kube_api, kube_logs
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.modes.deploy import Deployment
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire.calltree import LaunchRelay
from ktlite_wire.headers import TREE_HEADER
from ktlite_wire.outcome import CallResult
from ktlite_wire.version import PROTOCOL_VERSION

TOKEN = "tok-Requests-0123456789abcdef"
NAME = "job"
CLAIMS = "/api/v1/namespaces/default/persistentvolumeclaims"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    isolate_backend(monkeypatch, tmp_path)


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    made: list[Cluster] = []
    yield made
    for c in made:
        c.close()


def make(made: list[Cluster], behavior: kf.PodBehavior | None = None, **options: Any) -> Cluster:
    made.append(Cluster(behavior, **options))
    return made[-1]


def spec(workers: int, **compute: Any) -> DeploymentSpec:
    c = kt.Compute(backend="kubernetes", launch_timeout=120, **compute)
    return DeploymentSpec(NAME, c.distribute(workers=workers).pod_spec())


def pod_lists(c: Cluster, since: int = 0) -> list[kf.RecordedRequest]:
    """The LISTs of pods (not watches) since ``since``."""
    return [
        r
        for r in c.fake.requests[since:]
        if r.method == "GET" and r.path.endswith("/pods") and r.query.get("watch") != "true"
    ]


# ---- paging -----------------------------------------------------------------------------------


def test_every_list_asks_for_pages_and_follows_continue(clusters, monkeypatch) -> None:
    monkeypatch.setattr(kube_api, "PAGE", 4)
    c = make(clusters)
    c.fake.pages.max_page = 3  # fewer than asked, as a server may answer
    applied = c.backend.apply(spec(10), TOKEN)  # the readiness wait: LIST (paged), then WATCH
    assert [ep.ordinal for ep in applied.endpoints] == list(range(10))
    since = len(c.fake.requests)
    found = c.backend.lookup(NAME)
    assert found is not None and [ep.name for ep in found.endpoints] == [
        f"{NAME}-{i}" for i in range(10)
    ]
    lists = pod_lists(c, since)
    assert len(lists) == 4  # 3 + 3 + 3 + 1 pods
    assert all(r.query["limit"] == "4" for r in lists)
    assert "continue" not in lists[0].query and all("continue" in r.query for r in lists[1:])
    assert all(r.query["labelSelector"] == lists[0].query["labelSelector"] for r in lists)


def test_a_paged_list_is_one_snapshot_and_its_watch_starts_at_its_version(clusters) -> None:
    c = make(clusters)
    c.fake.pages.max_page = 2
    c.backend.apply(spec(5), TOKEN)
    api = KubeApi(c.http, "default")
    taken: list[tuple[list[Any], Any]] = []
    page = c.fake.pages.page

    def page_then_delete(query: dict[str, str], items: list[Any], rv: str) -> Any:
        out = page(query, items, rv)
        taken.append(out)
        if len(taken) == 1:  # between the first and the second page, a pod goes
            c.fake.objects("pods")  # (brought up to the clock first)
            c.fake._delete("pods", "default", f"{NAME}-4", {"gracePeriodSeconds": 0})
        return out

    c.fake.pages.page = page_then_delete  # type: ignore[method-assign]
    items, version = api.list_at("Pod", f"ktlite.dev/name={NAME}")
    assert sorted(p["metadata"]["name"] for p in items) == [f"{NAME}-{i}" for i in range(5)]
    assert {meta["resourceVersion"] for _, meta in taken} == {version}


def test_an_expired_page_token_lists_again_from_the_start(clusters, monkeypatch) -> None:
    monkeypatch.setattr(kube_api, "PAGE", 2)
    c = make(clusters)
    c.backend.apply(spec(5), TOKEN)
    page, expired = c.fake.pages.page, []

    def expire_once(query: dict[str, str], items: list[Any], rv: str) -> Any:
        if query.get("continue") and not expired:
            expired.append(query["continue"])
            c.fake.pages.expire()  # as after a compaction
        return page(query, items, rv)

    c.fake.pages.page = expire_once  # type: ignore[method-assign]
    since = len(c.fake.requests)
    found = c.backend.lookup(NAME)
    assert found is not None and len(found.endpoints) == 5
    assert expired
    assert len(pod_lists(c, since)) == 2 + 3  # the first page, its expired token, then 3 pages


def test_a_token_that_keeps_expiring_fails_the_list_saying_so(clusters, monkeypatch) -> None:
    monkeypatch.setattr(kube_api, "PAGE", 2)
    c = make(clusters)
    c.backend.apply(spec(5), TOKEN)
    page = c.fake.pages.page

    def always_expire(query: dict[str, str], items: list[Any], rv: str) -> Any:
        if query.get("continue"):
            c.fake.pages.expire()
        return page(query, items, rv)

    c.fake.pages.page = always_expire  # type: ignore[method-assign]
    since = len(c.fake.requests)
    with pytest.raises(KubeApiError, match="too old") as err:
        KubeApi(c.http, "default").list("Pod", f"ktlite.dev/name={NAME}")
    assert err.value.status == 410
    assert len(pod_lists(c, since)) == 2 * kube_api.LIST_ATTEMPTS


def test_the_stand_in_pages_only_when_asked(clusters) -> None:
    c = make(clusters)
    c.fake.pages.max_page = 2
    c.backend.apply(spec(5), TOKEN)
    whole = c.http.get("/api/v1/namespaces/default/pods").json()
    assert len(whole["items"]) == 5 and "continue" not in whole["metadata"]
    first = c.http.get("/api/v1/namespaces/default/pods", params={"limit": 10}).json()
    assert len(first["items"]) == 2 and first["metadata"]["remainingItemCount"] == 3
    bad = c.http.get("/api/v1/namespaces/default/pods", params={"continue": "x", "limit": 2})
    assert bad.status_code == 400


# ---- teardown's claims ------------------------------------------------------------------------


def claim_requests(c: Cluster, since: int) -> Counter[str]:
    return Counter(
        f"{r.method} {'collection' if r.path == CLAIMS else 'one'}"
        for r in c.fake.requests[since:]
        if r.path.startswith(CLAIMS)
    )


def test_teardown_with_volumes_deletes_the_claims_as_one_collection(clusters) -> None:
    c = make(clusters)
    vols = (kt.Volume("data", size="1Gi"), kt.Volume("ckpt", size="1Gi"))
    c.backend.apply(spec(3, volumes=vols), TOKEN)
    since = len(c.fake.requests)
    assert c.backend.teardown(NAME, volumes=True) is True
    assert c.fake.objects("persistentvolumeclaims") == []
    assert claim_requests(c, since) == Counter({"DELETE collection": 1})


def test_teardown_with_volumes_without_deletecollection_deletes_each_claim(clusters) -> None:
    c = make(clusters)
    c.backend.apply(spec(2, volumes=(kt.Volume("data", size="1Gi"),)), TOKEN)
    c.fake.fail_next("DELETE", "/persistentvolumeclaims$", 403, "Forbidden")
    since = len(c.fake.requests)
    assert c.backend.teardown(NAME, volumes=True) is True
    assert c.fake.objects("persistentvolumeclaims") == []
    assert claim_requests(c, since) == Counter(
        {"DELETE collection": 1, "GET collection": 1, "DELETE one": 1}
    )


# ---- every pod's log --------------------------------------------------------------------------


def test_every_pods_log_is_read_several_at_once_and_printed_in_order(clusters, monkeypatch) -> None:
    monkeypatch.setattr(kube_logs, "READERS", 3)
    c = make(clusters)
    c.backend.apply(spec(7), TOKEN)
    for i in range(7):
        c.fake.set_logs(f"{NAME}-{i}", f"pod {i} a\npod {i} b\n")
    handle, lock = c.fake.handle_request, threading.Lock()
    in_flight, most, second = [0], [0], threading.Event()

    def counted(request: Any) -> Any:
        if not request.url.path.endswith("/log"):
            return handle(request)
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            if in_flight[0] >= 2:
                second.set()
        try:
            # the first read waits (bounded) for a second to start: read one by one, it never would
            assert second.wait(10), "the pods' logs were read one at a time"
            return handle(request)
        finally:
            with lock:
                in_flight[0] -= 1

    c.fake.handle_request = counted  # type: ignore[method-assign]  (before the fake's lock)
    since = len(c.fake.requests)
    lines = list(c.backend.logs(NAME))
    assert lines == [f"[{NAME}-{i}] pod {i} {x}" for i in range(7) for x in "ab"]
    assert 2 <= most[0] <= 3
    assert c.requests(since) == Counter({"LIST": 1, "log": 7})  # the log API is per pod


def test_following_more_pods_than_streams_allowed_says_what_to_do(clusters, monkeypatch) -> None:
    monkeypatch.setattr(kube_logs, "FOLLOW_MAX", 3)
    c = make(clusters)
    c.backend.apply(spec(4), TOKEN)
    since = len(c.fake.requests)
    with pytest.raises(kt.DeployError, match="following the logs of 4 pods.*at most 3.*one pod"):
        list(c.backend.logs(NAME, follow=True))
    assert c.requests(since) == Counter({"LIST": 1})  # no stream was opened


# ---- what the caller asks the pods, through the pod proxy -------------------------------------


class StubPods(dict):  # type: ignore[type-arg]
    """The fake's proxy table: every pod a stub server. ``/status`` and ``/restart_failed``
    with ``x-ktlite-tree`` answer for every pod the header names, as pod 0 does once it has
    asked the others (that gathering runs on real pod servers in tests/test_pod_table.py)."""

    def get(self, key: Any, default: Any = None) -> Any:
        name = key[0]

        def answer(request: httpx.Request) -> httpx.Response:
            path = request.url.path
            if path == "/health":
                return httpx.Response(
                    200,
                    json={
                        "status": "ok",
                        "protocol": PROTOCOL_VERSION,
                        "python": platform.python_version(),
                        "pod": name,
                    },
                )
            if path == "/deploy":
                request.read()
                return httpx.Response(200, content=CallResult([]).encode_bytes())
            header = request.headers.get(TREE_HEADER)
            names = [name] if header is None else LaunchRelay.decode(header).names
            table = [
                {"pod": n, "ordinal": int(n.rsplit("-", 1)[1]), "ranks": [], "restarted": []}
                | {"failed": [], "colocated": []}
                for n in names
            ]
            return httpx.Response(200, json=table if header is not None else table[0])

        return answer


def test_status_restart_and_colocation_do_not_grow_with_the_pod_count(clusters) -> None:
    counts: dict[int, dict[str, Counter[str]]] = {}
    for n in (4, 40):
        c = make(clusters)
        c.fake.proxy_handlers = StubPods()
        s = spec(n)
        dep = Deployment(s, c.backend, c.backend.apply(s, TOKEN))
        dep.push(cloudpickle.dumps(len), {}, None)
        counts[n] = steps = {}
        for step in ("status", "restart_failed", "colocate"):
            since = len(c.fake.requests)
            if step == "status":
                assert len(dep.status()) == n
            elif step == "restart_failed":
                assert len(dep.restart_failed()["pods"]) == n
            else:
                dep.colocate("helper", "fn", cloudpickle.dumps(len), {}, None)
            steps[step] = c.requests(since)
    assert counts[4] == counts[40], counts
    assert all(kinds == Counter({"proxy": 1}) for kinds in counts[40].values()), counts[40]
