"""The Kubernetes backend at scale, against the stand-in API server on a fake clock: the
readiness wait and teardown follow the pods with one LIST and a WATCH, so their API requests
do not grow with the pod count (asserted as counts at two pod counts, never as times), and the
watch's edge cases (410 Gone, a dropped or stalled watch, a pod that never becomes Ready, a pod
replaced during the wait). Also the stand-in's watches themselves (``kube_fake_watch``)."""

from __future__ import annotations

import http.server
import io
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import kube_fake as kf
import pytest
from kube_cluster import Cluster as StandIn
from kube_unit import isolate_backend

import ktlite as kt
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.backends.kube_watch import PodWatch
from ktlite.errors import LaunchTimeout
from ktlite.specs.deployment_spec import DeploymentSpec

HOST = "https://fake-apiserver"
API_TOKEN = "api-bearer-watch"
TOKEN = "tok-Watch-0123456789abcdef"
NAME = "job"
PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    isolate_backend(monkeypatch, tmp_path)


class Cluster(StandIn):
    """The stand-in cluster (``kube_cluster``), with this module's credential."""

    api_token = API_TOKEN


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    made: list[Cluster] = []
    yield made
    for c in made:
        c.http.close()


def make(made: list[Cluster], behavior: kf.PodBehavior | None = None, **options: Any) -> Cluster:
    made.append(Cluster(behavior, **options))
    return made[-1]


def spec(workers: int, launch_timeout: float = 120) -> DeploymentSpec:
    compute = kt.Compute(backend="kubernetes", launch_timeout=launch_timeout)
    return DeploymentSpec(NAME, compute.distribute(workers=workers).pod_spec())


def booting(pod: dict[str, Any]) -> kf.PodScript:
    """Created, its container running from 4-7.5 s (by ordinal), Ready 2 s after that: for
    seconds every pod runs but is not Ready, when a wait that asks pods itself would."""
    run = 4.0 + (int(pod["metadata"]["name"].rsplit("-", 1)[1]) % 8) * 0.5
    return [
        (0, kf.pending()),
        (1, kf.container_creating()),
        (run, kf.running_not_ready()),
        (run + 2, kf.ready()),
    ]


# ---- requests per step, against the pod count --------------------------------------------------


def test_readiness_wait_requests_do_not_grow_with_the_pod_count(clusters) -> None:
    counts = {}
    for n in (4, 40):
        c = make(clusters, booting)
        since = len(c.fake.requests)
        applied = c.backend.apply(spec(n), TOKEN)
        assert len(applied.endpoints) == n
        counts[n] = c.requests(since)
        assert c.clock() == 4.0 + (min(n, 8) - 1) * 0.5 + 2  # the last pod's Ready, no later
    assert counts[4] == counts[40], counts
    assert counts[40]["proxy"] == 0  # no pod is asked anything by the wait
    assert counts[40]["LIST"] == 1 and counts[40]["WATCH"] >= 1


def test_teardown_requests_do_not_grow_with_the_pod_count(clusters) -> None:
    counts = {}
    for n in (4, 40):
        c = make(clusters, pod_termination_seconds=2)
        c.backend.apply(spec(n), TOKEN)
        since = len(c.fake.requests)
        assert c.backend.teardown(NAME) is True
        assert c.fake.objects("pods") == []
        counts[n] = c.requests(since)
    assert counts[4] == counts[40], counts
    assert counts[40]["DELETECOLLECTION"] == 1 and counts[40].get("DELETE pod", 0) == 0


def test_teardown_of_a_deployment_without_pods_opens_no_watch(clusters) -> None:
    # found on the real cluster: a second teardown (or one whose pods were already gone)
    # opened a watch on no pods and waited out its whole window (30 s) for an event that
    # could not come; here the fake clock would have moved by that window
    c = make(clusters, pod_termination_seconds=2)
    c.backend.apply(spec(4), TOKEN)
    assert c.backend.teardown(NAME) is True
    since, at = len(c.fake.requests), c.clock()
    assert c.backend.teardown(NAME) is False
    counts = c.requests(since)
    assert counts.get("WATCH", 0) == 0 and counts["LIST"] >= 1, counts
    assert c.clock() == at


def test_a_redeploy_that_restarts_every_pod_does_not_grow_with_the_pod_count(clusters) -> None:
    counts = {}
    for n in (4, 40):
        c = make(clusters)
        c.backend.apply(spec(n), TOKEN)
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.fake.objects("pods")}
        changed = DeploymentSpec(
            NAME,
            kt.Compute(backend="kubernetes", launch_timeout=120, env={"LR": "0.1"})
            .distribute(workers=n)
            .pod_spec(),
        )
        since = len(c.fake.requests)
        applied = c.backend.apply(changed, TOKEN)
        assert applied.restarted == list(range(n))
        after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.fake.objects("pods")}
        assert sorted(after) == sorted(before) and not set(after.values()) & set(before.values())
        counts[n] = c.requests(since)
    assert counts[4] == counts[40], counts
    assert counts[40]["DELETECOLLECTION"] == 1


def test_a_redeploy_of_ready_pods_says_one_progress_line(clusters) -> None:
    c = make(clusters)
    c.backend.apply(spec(3), TOKEN)
    out = c.backend._out
    assert isinstance(out, io.StringIO)
    out.seek(0)
    out.truncate()
    c.backend.apply(spec(3), TOKEN)
    assert out.getvalue().splitlines() == [
        f"ktlite: {NAME}: pods scheduled 3/3, running 3/3, ready 3/3"
    ]


def test_lookup_and_list_do_not_grow_with_the_pod_count(clusters) -> None:
    counts = {}
    for n in (4, 40):
        c = make(clusters)
        c.backend.apply(spec(n), TOKEN)
        since = len(c.fake.requests)
        found = c.backend.lookup(NAME)
        assert found is not None and len(found.endpoints) == n
        assert [row["pods"] for row in c.backend.list()] == [n]
        counts[n] = Counter(
            (r.method, re.sub(r"/[^/]*-\d+($|/)", "/POD\\1", r.path))
            for r in c.fake.requests[since:]
        )
    assert counts[4] == counts[40], counts


def test_an_account_without_deletecollection_deletes_pods_one_by_one(clusters) -> None:
    c = make(clusters, pod_termination_seconds=2)  # still listed after the StatefulSet goes
    c.backend.apply(spec(3), TOKEN)
    c.fake.fail_next("DELETE", "/pods$", 403, "Forbidden", "cannot deletecollection pods")
    assert c.backend.teardown(NAME) is True
    assert c.fake.objects("pods") == []
    assert c.requests()["DELETE pod"] == 3


# ---- the watch's edge cases --------------------------------------------------------------------


def test_wait_lists_again_after_410_gone(clusters) -> None:
    c = make(clusters, lambda pod: [(0, kf.pending()), (90, kf.ready())])
    # the watch the API server closes at 60 s is resumed from its last version: refused
    c.fake.watches.schedule(
        30, lambda: c.fake.fail_next("GET", "/pods$", 410, "Expired", "too old resource version")
    )
    applied = c.backend.apply(spec(2, launch_timeout=300), TOKEN)
    assert len(applied.endpoints) == 2 and 90 <= c.clock() < 92
    gone = [r for r in c.fake.find_requests("GET", "/pods$") if r.query.get("watch")]
    assert len(gone) >= 3  # the first watch, the refused resume, the one after the LIST
    assert c.requests()["LIST"] == 2


def test_watch_resumed_from_a_compacted_version_gets_410_as_an_error_event(clusters) -> None:
    c = make(clusters)
    c.backend.apply(spec(2), TOKEN)
    api = KubeApi(c.http, "default")
    pods, version = api.list_at("Pod", "ktlite.dev/name=job")
    assert len(pods) == 2 and version
    c.fake.watches.compact()
    c.fake.create(
        "pods",
        "default",
        {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
    )
    c.fake.watches.compact()
    with (
        pytest.raises(KubeApiError) as err,
        api.watch("Pod", None, version, timeout_s=5, stall_s=20) as events,
    ):
        list(events)
    assert err.value.status == 410 and "too old resource version" in str(err.value)

    watch = PodWatch(api, "ktlite.dev/name=job", c.clock, c.clock.advance)
    watch._version = version  # as if it had listed before the compaction
    watch._listed_at = c.clock()
    assert list(watch.changes(c.clock() + 5)) == [] and watch.lists == 0
    assert sorted(watch.changes(c.clock() + 5)) == [f"{NAME}-0", f"{NAME}-1"]
    assert watch.lists == 1


def test_wait_survives_a_dropped_watch(clusters) -> None:
    c = make(clusters, lambda pod: [(0, kf.pending()), (6, kf.ready())])
    c.fake.watches.schedule(3, c.fake.watches.drop)
    applied = c.backend.apply(spec(3), TOKEN)
    assert len(applied.endpoints) == 3 and 6 <= c.clock() < 8
    assert c.requests()["LIST"] == 2  # listed again after the drop


def test_a_stalled_watch_is_given_up_after_its_window_and_listed_again(clusters) -> None:
    c = make(clusters, lambda pod: [(0, kf.pending()), (6, kf.ready())])
    c.fake.watches.schedule(3, c.fake.watches.stall)
    c.fake.watches.schedule(4, lambda: c.fake.watches.stall(False))
    applied = c.backend.apply(spec(2, launch_timeout=600), TOKEN)
    assert len(applied.endpoints) == 2
    # silent from 3 s: the client gave up at its read timeout (the window, 60 s, + 15 s)
    assert 75 <= c.clock() < 80, c.clock()
    assert c.requests()["LIST"] == 2


def test_a_pod_that_never_becomes_ready_is_named_at_the_timeout(clusters) -> None:
    c = make(
        clusters,
        lambda pod: (
            [(0, kf.container_creating()), (2, kf.running_not_ready())]
            if pod["metadata"]["name"] == f"{NAME}-2"
            else kf.ready()
        ),
    )
    with pytest.raises(LaunchTimeout) as err:
        c.backend.apply(spec(4, launch_timeout=30), TOKEN)
    message = str(err.value)
    assert "ready 3/4" in message and f"not Ready: {NAME}-2 (running" in message, message
    assert f"describe pod {NAME}-2" in message
    assert 30 <= c.clock() < 32
    assert c.requests()["LIST"] == 1  # one list, then watches, for all 30 s


def test_a_pod_replaced_during_the_wait_counts_as_its_successor(clusters) -> None:
    c = make(clusters, lambda pod: [(0, kf.pending()), (5, kf.ready())], pod_termination_seconds=1)
    first: dict[str, str] = {}

    def replace() -> None:
        pod = c.fake._store[("pods", "default", f"{NAME}-1")]
        first["uid"] = pod["metadata"]["uid"]
        c.fake._delete("pods", "default", f"{NAME}-1", {})

    c.fake.watches.schedule(3, replace)
    applied = c.backend.apply(spec(2), TOKEN)
    successor = c.fake.get("pods", "default", f"{NAME}-1")
    assert successor is not None and successor["metadata"]["uid"] != first["uid"]
    assert applied.endpoints[1].incarnation.startswith(successor["metadata"]["uid"])
    # its successor's own start: made at 3 s (a pod no kubelet ran goes at once), Ready at 8 s
    assert c.clock() == 3 + 5


def test_an_account_that_may_not_watch_lists_instead(clusters) -> None:
    c = make(clusters, lambda pod: [(0, kf.pending()), (4, kf.ready())])
    original = c.fake.handle_request

    def refuse_watches(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("watch") == "true":
            return httpx.Response(403, json=kf.status_body(403, "Forbidden", "cannot watch pods"))
        return original(request)

    c.fake.handle_request = refuse_watches  # type: ignore[method-assign]
    applied = c.backend.apply(spec(2), TOKEN)
    assert len(applied.endpoints) == 2 and 4 <= c.clock() < 6
    assert c.requests()["LIST"] >= 4  # listed every second instead


# ---- the stand-in's watches ---------------------------------------------------------------------


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }


def test_stand_in_watch_is_chunked_json_lines_with_bookmarks_and_ends_at_timeout(clusters) -> None:
    c = make(clusters, lambda pod: [(0, kf.pending()), (2, kf.ready())])
    version = c.http.get(PODS).json()["metadata"]["resourceVersion"]
    c.fake.create("pods", "default", _pod("a", {"app": "x"}))
    c.fake.create("pods", "default", _pod("b", {"app": "y"}))
    params = {
        "watch": "true",
        "resourceVersion": version,
        "timeoutSeconds": "10",
        "allowWatchBookmarks": "true",
        "labelSelector": "app=x",
    }
    with c.http.stream("GET", PODS, params=params) as resp:
        assert resp.headers["transfer-encoding"] == "chunked"
        events = [json.loads(line) for line in resp.iter_lines()]
    assert [(e["type"], e["object"]["metadata"].get("name")) for e in events] == [
        ("ADDED", "a"),
        ("MODIFIED", "a"),
        ("BOOKMARK", None),
    ]
    assert c.clock() == 10  # the server closed it after timeoutSeconds
    assert int(events[-1]["object"]["metadata"]["resourceVersion"]) >= int(
        events[1]["object"]["metadata"]["resourceVersion"]
    )


def test_stand_in_watch_sends_deleted_when_an_object_leaves_the_selector(clusters) -> None:
    c = make(clusters)
    c.fake.create("pods", "default", _pod("a", {"app": "x"}))
    version = c.http.get(PODS).json()["metadata"]["resourceVersion"]
    c.fake.watches.schedule(
        1,
        lambda: c.fake._patch(
            "pods",
            "default",
            "a",
            b'{"metadata":{"labels":{"app":"z"}}}',
            "application/merge-patch+json",
            {},
        ),
    )
    params = {
        "watch": "true",
        "resourceVersion": version,
        "timeoutSeconds": "3",
        "labelSelector": "app=x",
    }
    with c.http.stream("GET", PODS, params=params) as resp:
        types = [json.loads(line)["type"] for line in resp.iter_lines()]
    assert types == ["DELETED"]


def test_stand_in_watch_from_version_zero_starts_with_the_state(clusters) -> None:
    c = make(clusters)
    c.fake.create("pods", "default", _pod("a", {"app": "x"}))
    params = {"watch": "true", "resourceVersion": "0", "timeoutSeconds": "1"}
    with c.http.stream("GET", PODS, params=params) as resp:
        lines = [json.loads(line) for line in resp.iter_lines()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [("ADDED", "a")]


# ---- over real HTTP: a real read timeout, a real broken chunked body ---------------------------


class _Served:
    """The fake API server on a real clock behind a real HTTP server (chunked answers)."""

    def __init__(self) -> None:
        self.fake = kf.FakeKube(token=API_TOKEN)
        fake = self.fake

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                headers = [(k, v) for k, v in self.headers.items() if k.lower() != "host"]
                resp = fake.handle_request(
                    httpx.Request("GET", f"http://fake{self.path}", headers=headers)
                )
                self.send_response(resp.status_code)
                self.send_header("content-type", "application/json")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                try:
                    for chunk in resp.stream:  # type: ignore[union-attr]
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (httpx.HTTPError, OSError):  # cut: no last chunk, the connection goes
                    self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{self.server.server_address[1]}",
            headers={"authorization": f"Bearer {API_TOKEN}"},
        )

    def close(self) -> None:
        self.fake.watches.stall(False)
        self.http.close()
        self.server.shutdown()
        self.server.server_close()


def test_over_http_a_stalled_or_dropped_watch_is_given_up_and_listed_again() -> None:
    served = _Served()
    try:
        served.fake.create("pods", "default", _pod("p-0", {"app": "x"}))
        api = KubeApi(served.http, "default")
        watch = PodWatch(api, "app=x", time.monotonic, time.sleep, stall_s=0.5)
        assert list(watch.changes(time.monotonic() + 1)) == ["p-0"]  # the LIST, a quiet watch
        assert (watch.lists, watch.watches) == (1, 1) and watch._version

        served.fake.watches.stall()  # silent past its end: only the read timeout ends it
        assert list(watch.changes(time.monotonic() + 1)) == []
        assert watch._version == ""  # given up: the next change is a LIST
        served.fake.watches.stall(False)
        assert list(watch.changes(time.monotonic() + 1)) == []  # nothing changed meanwhile
        assert watch.lists == 2

        served.fake.watches.schedule(time.monotonic() + 0.3, served.fake.watches.drop)
        assert list(watch.changes(time.monotonic() + 5)) == []  # the body cut short
        assert watch._version == ""
        served.fake.create("pods", "default", _pod("p-1", {"app": "x"}))
        assert list(watch.changes(time.monotonic() + 1)) == ["p-1"]
        assert watch.lists == 3 and sorted(watch.pods) == ["p-0", "p-1"]
    finally:
        served.close()
