"""Tests of the fake Kubernetes API server in kube_fake.py: the backend's tests lean on it
behaving like a real one, so its own behaviour is pinned down here."""

from __future__ import annotations

import base64
import threading

import httpx
import pytest
from kube_fake import (
    FakeClock,
    FakeKube,
    container_creating,
    crash_loop,
    create_container_config_error,
    err_image_pull,
    image_pull_backoff,
    oom_killed,
    ready,
    running_not_ready,
    terminated_error,
    unschedulable,
)

TOKEN = "s3cret"
PODS = "/api/v1/namespaces/default/pods"
STS = "/apis/apps/v1/namespaces/default/statefulsets"
MERGE = {"content-type": "application/merge-patch+json"}
STRATEGIC = {"content-type": "application/strategic-merge-patch+json"}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake(clock: FakeClock) -> FakeKube:
    return FakeKube(token=TOKEN, clock=clock, namespaces=("default", "other"))


@pytest.fixture
def client(fake: FakeKube):
    with httpx.Client(
        transport=fake,
        base_url="https://fake-apiserver",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as c:
        yield c


def pod(
    name: str,
    labels: dict[str, str] | None = None,
    image: str = "python:3.11",
    containers: int = 1,
    **spec,
) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "containers": [
                {
                    "name": "main" if i == 0 else f"side{i}",
                    "image": image,
                    "ports": [{"containerPort": 8000}],
                }
                for i in range(containers)
            ],
            **spec,
        },
    }


def sts(
    name: str = "w",
    replicas: int = 2,
    image: str = "python:3.11",
    *,
    policy: str = "Parallel",
    strategy: str | None = None,
) -> dict:
    spec = {
        "replicas": replicas,
        "serviceName": name,
        "podManagementPolicy": policy,
        "selector": {"matchLabels": {"app": name}},
        "template": {
            "metadata": {"labels": {"app": name, "team": "ml"}, "annotations": {"note": "x"}},
            "spec": {"containers": [{"name": "main", "image": image}]},
        },
    }
    if strategy:
        spec["updateStrategy"] = {"type": strategy}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": spec,
    }


def status_of(response: httpx.Response, code: int, reason: str) -> dict:
    assert response.status_code == code, response.text
    body = response.json()
    assert body["kind"] == "Status" and body["status"] == "Failure"
    assert body["code"] == code and body["reason"] == reason
    return body


def cstatus(client: httpx.Client, name: str) -> dict:
    return client.get(f"{PODS}/{name}").json()["status"]["containerStatuses"][0]


# --------------------------------------------------------------------------- basic REST
def test_create_get_list(client: httpx.Client, fake: FakeKube) -> None:
    r = client.post(PODS, json=pod("a", {"app": "x"}))
    assert r.status_code == 201
    created = r.json()
    meta = created["metadata"]
    assert created["kind"] == "Pod" and meta["namespace"] == "default"
    assert meta["uid"] and meta["resourceVersion"].isdigit() and meta["generation"] == 1
    assert meta["creationTimestamp"].endswith("Z")
    assert created["spec"]["restartPolicy"] == "Always"
    assert created["spec"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    assert created["status"] == {"phase": "Pending", "qosClass": "BestEffort"}

    got = client.get(f"{PODS}/a").json()
    assert got["metadata"]["uid"] == meta["uid"]
    assert got["status"]["phase"] == "Running"  # default behaviour: ready at once
    assert int(got["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])

    listed = client.get(PODS).json()
    assert listed["kind"] == "PodList" and listed["apiVersion"] == "v1"
    assert listed["metadata"]["resourceVersion"].isdigit()
    assert [p["metadata"]["name"] for p in listed["items"]] == ["a"]
    assert "kind" not in listed["items"][0]  # like the real server's typed lists
    assert client.get("/api/v1/pods").json()["items"][0]["metadata"]["name"] == "a"
    assert client.get("/api/v1/namespaces/other/pods").json()["items"] == []
    assert [p["metadata"]["name"] for p in fake.objects("Pod", "default")] == ["a"]
    assert fake.get("pods", "default", "a")["status"]["phase"] == "Running"
    assert fake.get("pods", "default", "zz") is None


def test_errors_have_status_bodies(client: httpx.Client) -> None:
    body = status_of(client.get(f"{PODS}/nope"), 404, "NotFound")
    assert body["message"] == 'pods "nope" not found'
    assert body["details"] == {"name": "nope", "kind": "pods"}
    assert (
        status_of(client.get(f"{STS}/nope"), 404, "NotFound")["message"]
        == 'statefulsets.apps "nope" not found'
    )

    client.post(PODS, json=pod("a"))
    body = status_of(client.post(PODS, json=pod("a")), 409, "AlreadyExists")
    assert body["message"] == 'pods "a" already exists'

    nameless = pod("x")
    del nameless["metadata"]["name"]
    body = status_of(client.post(PODS, json=nameless), 422, "Invalid")
    assert "metadata.name: Required value" in body["message"]
    assert status_of(client.post(PODS, json=pod("Bad_Name")), 422, "Invalid")
    assert status_of(client.post(PODS, json=pod("l", {"k": "x" * 64})), 422, "Invalid")
    assert (
        status_of(client.post(PODS, json={"metadata": {"name": "c"}, "spec": {}}), 422, "Invalid")[
            "details"
        ]["causes"][0]["field"]
        == "spec.containers"
    )

    body = status_of(client.post("/api/v1/namespaces/ghost/pods", json=pod("a")), 404, "NotFound")
    assert body["message"] == 'namespaces "ghost" not found'
    assert status_of(client.get("/api/v1/namespaces/default/widgets"), 404, "NotFound")
    assert status_of(client.get("/apis/apps/v1/namespaces/default/pods"), 404, "NotFound")
    assert status_of(client.get("/nothing/here"), 404, "NotFound")
    assert status_of(client.put(f"{PODS}/nope", json=pod("nope")), 404, "NotFound")
    assert status_of(client.post(PODS, content=b"{not json"), 400, "BadRequest")


def test_namespaces(client: httpx.Client) -> None:
    ns = client.get("/api/v1/namespaces/default").json()
    assert ns["kind"] == "Namespace" and ns["status"]["phase"] == "Active"
    assert (
        status_of(client.get("/api/v1/namespaces/ghost"), 404, "NotFound")["message"]
        == 'namespaces "ghost" not found'
    )
    names = [n["metadata"]["name"] for n in client.get("/api/v1/namespaces").json()["items"]]
    assert names == ["default", "other"]


def test_auth_and_recording(fake: FakeKube) -> None:
    with httpx.Client(transport=fake, base_url="https://fake-apiserver") as anon:
        body = status_of(anon.get(PODS), 401, "Unauthorized")
        assert body["message"] == "Unauthorized"
        assert anon.get(PODS, headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = anon.post(
            PODS,
            json=pod("a"),
            params={"fieldManager": "t"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 201
    assert [(q.method, q.path) for q in fake.requests] == [("GET", PODS)] * 2 + [("POST", PODS)]
    last = fake.requests[-1]
    assert last.query == {"fieldManager": "t"} and last.body["metadata"]["name"] == "a"
    assert fake.find_requests("POST", r"/pods$") == [last]
    open_fake = FakeKube()
    with httpx.Client(transport=open_fake, base_url="https://fake-apiserver") as c:
        assert c.get(PODS).status_code == 200  # built without a token: no auth


def test_selectors(client: httpx.Client, fake: FakeKube) -> None:
    client.post(PODS, json=pod("a", {"app": "x", "tier": "web"}))
    client.post(PODS, json=pod("b", {"app": "x"}))
    client.post(PODS, json=pod("c", {"app": "y", "tier": "db"}))

    def names(**params: str) -> list[str]:
        r = client.get(PODS, params=params)
        assert r.status_code == 200, r.text
        return [p["metadata"]["name"] for p in r.json()["items"]]

    assert names(labelSelector="app=x") == ["a", "b"]
    assert names(labelSelector="app==x,tier=web") == ["a"]
    assert names(labelSelector="app!=x") == ["c"]
    assert names(labelSelector="tier!=web") == ["b", "c"]  # != matches a missing key
    assert names(labelSelector="tier") == ["a", "c"]
    assert names(labelSelector="!tier") == ["b"]
    assert names(labelSelector="tier in (web,db),app notin (y)") == ["a"]
    assert names(fieldSelector="metadata.name=b") == ["b"]
    assert names(fieldSelector="metadata.name!=b,status.phase=Running") == ["a", "c"]
    fake.add_event("a", "Custom", "something happened")
    events = client.get(
        "/api/v1/namespaces/default/events",
        params={"fieldSelector": "involvedObject.name=a,reason=Custom"},
    ).json()
    assert events["kind"] == "EventList"
    [event] = events["items"]
    assert event["message"] == "something happened" and event["type"] == "Warning"
    assert event["involvedObject"]["kind"] == "Pod"
    assert event["involvedObject"]["uid"] == fake.get("pod", "default", "a")["metadata"]["uid"]


def test_put_patch_and_conflicts(client: httpx.Client) -> None:
    created = client.post(PODS, json=pod("a", {"app": "x"})).json()
    current = client.get(f"{PODS}/a").json()

    stale = dict(created, metadata={**created["metadata"], "labels": {"app": "z"}})
    body = status_of(client.put(f"{PODS}/a", json=stale), 409, "Conflict")
    assert "the object has been modified" in body["message"]

    current["metadata"]["labels"] = {"app": "y"}
    current["status"] = {"phase": "Failed"}  # status is not written through the main resource
    replaced = client.put(f"{PODS}/a", json=current).json()
    assert replaced["metadata"]["labels"] == {"app": "y"}
    assert replaced["status"]["phase"] == "Running"
    assert replaced["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]
    mismatch = dict(replaced, metadata={**replaced["metadata"], "name": "b"})
    assert status_of(client.put(f"{PODS}/a", json=mismatch), 400, "BadRequest")

    patched = client.patch(
        f"{PODS}/a",
        headers=MERGE,
        json={"metadata": {"labels": {"extra": "1", "app": None}, "annotations": {"k": "v"}}},
    ).json()
    assert patched["metadata"]["labels"] == {"extra": "1"}
    assert patched["metadata"]["annotations"] == {"k": "v"}
    noop = client.patch(f"{PODS}/a", headers=MERGE, json={"metadata": {"labels": {"extra": "1"}}})
    assert noop.json()["metadata"]["resourceVersion"] == patched["metadata"]["resourceVersion"]
    stale_patch = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}}
    assert status_of(client.patch(f"{PODS}/a", headers=MERGE, json=stale_patch), 409, "Conflict")
    assert status_of(client.patch(f"{PODS}/nope", headers=MERGE, json={}), 404, "NotFound")
    assert status_of(
        client.patch(
            f"{PODS}/a",
            json=[{"op": "add"}],
            headers={"content-type": "application/json-patch+json"},
        ),
        415,
        "UnsupportedMediaType",
    )


def test_strategic_merge_keeps_other_containers(client: httpx.Client) -> None:
    client.post(STS, json=sts("w", 0))
    two = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "main", "image": "python:3.12"},
                        {"name": "side", "image": "busybox"},
                    ]
                }
            }
        }
    }
    client.patch(f"{STS}/w", headers=STRATEGIC, json=two)
    r = client.patch(
        f"{STS}/w",
        headers=STRATEGIC,
        json={
            "spec": {
                "template": {"spec": {"containers": [{"name": "side", "image": "busybox:1.36"}]}}
            }
        },
    )
    containers = r.json()["spec"]["template"]["spec"]["containers"]
    assert [(c["name"], c["image"]) for c in containers] == [
        ("main", "python:3.12"),
        ("side", "busybox:1.36"),
    ]
    assert r.json()["metadata"]["generation"] == 3
    r = client.patch(
        f"{STS}/w",
        headers=MERGE,
        json={
            "spec": {"template": {"spec": {"containers": [{"name": "side", "image": "busybox"}]}}}
        },
    )
    assert [c["name"] for c in r.json()["spec"]["template"]["spec"]["containers"]] == ["side"]


def test_server_side_apply_creates_then_merges(client: httpx.Client) -> None:
    apply = {"content-type": "application/apply-patch+yaml"}
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s"},
        "stringData": {"token": "abc"},
    }
    url = "/api/v1/namespaces/default/secrets/s"
    assert status_of(client.patch(url, headers=apply, json=body), 422, "Invalid")
    r = client.patch(url, headers=apply, json=body, params={"fieldManager": "ktlite"})
    assert r.status_code == 201
    assert r.json()["data"] == {"token": base64.b64encode(b"abc").decode()}
    assert r.json()["type"] == "Opaque" and "stringData" not in r.json()
    body["metadata"]["labels"] = {"a": "b"}
    r = client.patch(url, headers=apply, json=body, params={"fieldManager": "ktlite"})
    assert r.status_code == 200 and r.json()["metadata"]["labels"] == {"a": "b"}


def test_delete_and_deletecollection(client: httpx.Client, fake: FakeKube) -> None:
    client.post(PODS, json=pod("a", {"app": "x"}))
    client.post(PODS, json=pod("b", {"app": "x"}))
    client.post(PODS, json=pod("c", {"app": "y"}))
    r = client.delete(f"{PODS}/a")
    assert r.status_code == 200
    assert r.json()["kind"] == "Pod" and r.json()["metadata"]["deletionTimestamp"]
    assert status_of(client.delete(f"{PODS}/a"), 404, "NotFound")
    uid = client.get(f"{PODS}/b").json()["metadata"]["uid"]
    precondition = {"preconditions": {"uid": "other"}}
    assert status_of(client.request("DELETE", f"{PODS}/b", json=precondition), 409, "Conflict")
    r = client.request("DELETE", f"{PODS}/b", json={"preconditions": {"uid": uid}})
    assert r.status_code == 200

    client.post("/api/v1/namespaces/default/secrets", json={"metadata": {"name": "s"}})
    r = client.delete("/api/v1/namespaces/default/secrets/s")
    assert r.json()["kind"] == "Status" and r.json()["status"] == "Success"
    assert r.json()["details"]["name"] == "s"

    client.post(PODS, json=pod("d", {"app": "y"}))
    r = client.delete(PODS, params={"labelSelector": "app=y"})
    assert r.json()["kind"] == "PodList"
    assert sorted(p["metadata"]["name"] for p in r.json()["items"]) == ["c", "d"]
    assert fake.objects("pods") == []


def test_services_and_pvcs_get_defaults(client: httpx.Client) -> None:
    svc = client.post(
        "/api/v1/namespaces/default/services",
        json={
            "metadata": {"name": "w"},
            "spec": {
                "clusterIP": "None",
                "selector": {"app": "w"},
                "ports": [{"name": "http", "port": 8000}],
            },
        },
    ).json()
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"][0] == {
        "name": "http",
        "port": 8000,
        "protocol": "TCP",
        "targetPort": 8000,
    }
    other = client.post(
        "/api/v1/namespaces/default/services",
        json={"metadata": {"name": "v"}, "spec": {"ports": [{"port": 80}]}},
    ).json()
    assert other["spec"]["clusterIP"].startswith("10.96.")
    bad = client.post("/api/v1/namespaces/default/services", json={"metadata": {"name": "1abc"}})
    assert status_of(bad, 422, "Invalid")
    pvc = client.post(
        "/api/v1/namespaces/default/persistentvolumeclaims",
        json={
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "5Gi"}},
            },
        },
    ).json()
    assert pvc["status"]["phase"] == "Bound" and pvc["status"]["capacity"] == {"storage": "5Gi"}


def test_injected_failures(client: httpx.Client, fake: FakeKube) -> None:
    client.post(PODS, json=pod("a"))
    fake.fail_next(
        "POST",
        r"/pods$",
        403,
        "Forbidden",
        'pods is forbidden: User "x" cannot '
        'create resource "pods" in API group "" in the namespace "default"',
    )
    fake.fail_next("*", r"/pods/a$", 500, "InternalError", times=2)
    body = status_of(client.post(PODS, json=pod("b")), 403, "Forbidden")
    assert body["message"].startswith("pods is forbidden")
    assert client.post(PODS, json=pod("b")).status_code == 201  # only once
    assert status_of(client.get(f"{PODS}/a"), 500, "InternalError")
    assert status_of(client.delete(f"{PODS}/a"), 500, "InternalError")
    assert client.get(f"{PODS}/a").status_code == 200
    fake.fail_next("PUT", "/pods/a", 409, "Conflict", "the object has been modified")
    assert status_of(client.put(f"{PODS}/a", json=pod("a")), 409, "Conflict")


def test_concurrent_requests(client: httpx.Client, fake: FakeKube) -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(5):
                assert client.post(PODS, json=pod(f"p{i}-{j}")).status_code == 201
                assert client.get(PODS).status_code == 200
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ips = {p["status"]["podIP"] for p in fake.objects("pods", "default")}
    assert len(ips) == 40


# --------------------------------------------------------------------------- StatefulSets
def pods_of(fake: FakeKube, name: str = "w") -> dict[str, dict]:
    return {
        p["metadata"]["name"]: p
        for p in fake.objects("pods", "default")
        if p["metadata"]["name"].startswith(name + "-")
    }


def test_statefulset_creates_pods(client: httpx.Client, fake: FakeKube) -> None:
    created = client.post(STS, json=sts("w", 3)).json()
    assert created["status"] == {"replicas": 0, "availableReplicas": 0}
    assert created["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"partition": 0},
    }
    pods = pods_of(fake)
    assert sorted(pods) == ["w-0", "w-1", "w-2"]
    p = pods["w-1"]
    labels = p["metadata"]["labels"]
    assert labels["app"] == "w" and labels["team"] == "ml"
    assert labels["statefulset.kubernetes.io/pod-name"] == "w-1"
    assert labels["apps.kubernetes.io/pod-index"] == "1"
    assert labels["controller-revision-hash"].startswith("w-")
    assert p["metadata"]["annotations"] == {"note": "x"}
    assert p["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": "w",
            "uid": created["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert p["spec"]["hostname"] == "w-1" and p["spec"]["subdomain"] == "w"
    assert p["spec"]["nodeName"].startswith("kind-worker")
    status = client.get(f"{STS}/w").json()["status"]
    assert status["replicas"] == status["readyReplicas"] == status["updatedReplicas"] == 3
    assert (
        status["currentRevision"] == status["updateRevision"] == labels["controller-revision-hash"]
    )
    assert status["observedGeneration"] == 1
    reasons = [
        e["reason"]
        for e in fake.objects("events", "default")
        if e["involvedObject"]["kind"] == "StatefulSet"
    ]
    assert reasons == ["SuccessfulCreate"] * 3


def test_statefulset_validation(client: httpx.Client) -> None:
    bad = sts("w")
    bad["spec"]["selector"] = {"matchLabels": {"app": "other"}}
    assert (
        "does not match template"
        in status_of(client.post(STS, json=bad), 422, "Invalid")["message"]
    )
    never = sts("w")
    never["spec"]["template"]["spec"]["restartPolicy"] = "Never"
    assert status_of(client.post(STS, json=never), 422, "Invalid")
    client.post(STS, json=sts("w"))
    body = status_of(
        client.patch(f"{STS}/w", headers=MERGE, json={"spec": {"serviceName": "x"}}), 422, "Invalid"
    )
    assert "updates to statefulset spec for fields other than" in body["message"]
    assert (
        client.patch(f"{STS}/w", headers=MERGE, json={"spec": {"replicas": 5}}).json()["metadata"][
            "generation"
        ]
        == 2
    )


def test_ordered_ready_waits_for_readiness(clock: FakeClock) -> None:
    fake = FakeKube(clock=clock, pod_behavior=lambda p: [(0, container_creating()), (5, ready())])
    fake.create("statefulset", "default", sts("w", 3, policy="OrderedReady"))
    assert sorted(pods_of(fake)) == ["w-0"]
    assert pods_of(fake)["w-0"]["status"]["phase"] == "Pending"
    clock.advance(5)
    assert sorted(pods_of(fake)) == ["w-0", "w-1"]
    clock.advance(5)
    assert sorted(pods_of(fake)) == ["w-0", "w-1", "w-2"]
    clock.advance(5)
    assert fake.get("statefulset", "default", "w")["status"]["readyReplicas"] == 3


def test_scale_down_and_up(client: httpx.Client, fake: FakeKube) -> None:
    client.post(STS, json=sts("w", 4))
    client.patch(f"{STS}/w", headers=MERGE, json={"spec": {"replicas": 2}})
    assert sorted(pods_of(fake)) == ["w-0", "w-1"]
    client.patch(f"{STS}/w", headers=MERGE, json={"spec": {"replicas": 3}})
    assert sorted(pods_of(fake)) == ["w-0", "w-1", "w-2"]


def test_deleted_pod_is_recreated(client: httpx.Client, fake: FakeKube) -> None:
    client.post(STS, json=sts("w", 2))
    old = pods_of(fake)["w-1"]
    client.delete(f"{PODS}/w-1")
    new = client.get(f"{PODS}/w-1").json()
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["status"]["phase"] == "Running"
    assert new["status"]["podIP"] != old["status"]["podIP"]


def test_rolling_update_replaces_pods(client: httpx.Client, fake: FakeKube) -> None:
    client.post(STS, json=sts("w", 3))
    before = {n: p["metadata"]["uid"] for n, p in pods_of(fake).items()}
    client.patch(
        f"{STS}/w",
        headers=STRATEGIC,
        json={
            "spec": {
                "template": {"spec": {"containers": [{"name": "main", "image": "python:3.12"}]}}
            }
        },
    )
    after = pods_of(fake)
    assert all(after[n]["metadata"]["uid"] != before[n] for n in before)
    assert {p["spec"]["containers"][0]["image"] for p in after.values()} == {"python:3.12"}
    status = client.get(f"{STS}/w").json()["status"]
    assert status["currentRevision"] == status["updateRevision"]
    assert status["updatedReplicas"] == 3


def test_rolling_update_stalls_on_unhealthy_pod(client: httpx.Client, fake: FakeKube) -> None:
    fake.pod_behavior = lambda p: (
        image_pull_backoff() if p["spec"]["containers"][0]["image"] == "broken" else ready()
    )
    client.post(STS, json=sts("w", 3))
    client.patch(
        f"{STS}/w",
        headers=STRATEGIC,
        json={
            "spec": {"template": {"spec": {"containers": [{"name": "main", "image": "broken"}]}}}
        },
    )
    images = {n: p["spec"]["containers"][0]["image"] for n, p in pods_of(fake).items()}
    assert images == {"w-0": "python:3.11", "w-1": "python:3.11", "w-2": "broken"}
    status = client.get(f"{STS}/w").json()["status"]
    assert status["updatedReplicas"] == 1 and status["readyReplicas"] == 2
    assert status["currentRevision"] != status["updateRevision"]


def test_on_delete_keeps_old_pods(client: httpx.Client, fake: FakeKube) -> None:
    client.post(STS, json=sts("w", 2, strategy="OnDelete"))
    old_hash = pods_of(fake)["w-0"]["metadata"]["labels"]["controller-revision-hash"]
    client.patch(
        f"{STS}/w",
        headers=STRATEGIC,
        json={
            "spec": {
                "template": {"spec": {"containers": [{"name": "main", "image": "python:3.12"}]}}
            }
        },
    )
    pods = pods_of(fake)
    assert {p["spec"]["containers"][0]["image"] for p in pods.values()} == {"python:3.11"}
    client.delete(f"{PODS}/w-0")
    pods = pods_of(fake)
    assert pods["w-0"]["spec"]["containers"][0]["image"] == "python:3.12"
    assert pods["w-0"]["metadata"]["labels"]["controller-revision-hash"] != old_hash
    assert pods["w-1"]["spec"]["containers"][0]["image"] == "python:3.11"
    status = client.get(f"{STS}/w").json()["status"]
    assert status["updatedReplicas"] == 1 and status["currentReplicas"] == 1


def test_delete_statefulset_cascades_or_orphans(client: httpx.Client, fake: FakeKube) -> None:
    client.post(STS, json=sts("w", 2))
    r = client.delete(f"{STS}/w")
    assert r.json()["kind"] == "Status" and r.json()["details"]["group"] == "apps"
    assert pods_of(fake) == {}

    client.post(STS, json=sts("w", 2))
    r = client.request("DELETE", f"{STS}/w", json={"propagationPolicy": "Orphan"})
    assert r.json()["kind"] == "StatefulSet"
    assert r.json()["metadata"]["finalizers"] == ["orphan"]
    pods = pods_of(fake)
    assert sorted(pods) == ["w-0", "w-1"]
    assert all("ownerReferences" not in p["metadata"] for p in pods.values())
    client.post(STS, json=sts("w", 2))  # a new StatefulSet adopts its orphans
    uid = client.get(f"{STS}/w").json()["metadata"]["uid"]
    assert all(p["metadata"]["ownerReferences"][0]["uid"] == uid for p in pods_of(fake).values())

    client.post(
        "/api/v1/namespaces/default/services",
        json={
            "metadata": {
                "name": "w",
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "w", "uid": uid}
                ],
            },
            "spec": {},
        },
    )
    client.delete(f"{STS}/w", params={"propagationPolicy": "Background"})
    assert fake.objects("services") == [] and pods_of(fake) == {}


def test_termination_grace(clock: FakeClock) -> None:
    fake = FakeKube(clock=clock, pod_termination_seconds=10)
    fake.create("statefulsets", "default", sts("w", 1))
    uid = fake.get("pods", "default", "w-0")["metadata"]["uid"]
    with httpx.Client(transport=fake, base_url="https://fake-apiserver") as client:
        r = client.delete(f"{PODS}/w-0")
        assert r.json()["metadata"]["deletionGracePeriodSeconds"] == 30
        terminating = client.get(f"{PODS}/w-0").json()
        assert terminating["metadata"]["uid"] == uid
        assert terminating["metadata"]["deletionTimestamp"]
        assert client.get(STS + "/w").json()["status"]["replicas"] == 0
        clock.advance(10)
        fresh = client.get(f"{PODS}/w-0").json()
        assert fresh["metadata"]["uid"] != uid and "deletionTimestamp" not in fresh["metadata"]
        client.request("DELETE", f"{PODS}/w-0", json={"gracePeriodSeconds": 0})
        assert client.get(f"{PODS}/w-0").json()["metadata"]["uid"] != fresh["metadata"]["uid"]


def test_volume_claim_templates(client: httpx.Client, fake: FakeKube) -> None:
    body = sts("w", 2)
    body["spec"]["volumeClaimTemplates"] = [
        {
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
    ]
    client.post(STS, json=body)
    claims = [c["metadata"]["name"] for c in fake.objects("persistentvolumeclaims", "default")]
    assert claims == ["data-w-0", "data-w-1"]
    volumes = pods_of(fake)["w-0"]["spec"]["volumes"]
    assert volumes == [{"name": "data", "persistentVolumeClaim": {"claimName": "data-w-0"}}]


# --------------------------------------------------------------------------- pod scripts
def test_ready_status_shape(client: httpx.Client, fake: FakeKube) -> None:
    fake.set_pod_script("a", ready(ip="10.9.8.7"))
    client.post(PODS, json=pod("a"))
    status = client.get(f"{PODS}/a").json()["status"]
    assert status["phase"] == "Running"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {
        "PodReadyToStartContainers": "True",
        "Initialized": "True",
        "Ready": "True",
        "ContainersReady": "True",
        "PodScheduled": "True",
    }
    assert status["podIP"] == "10.9.8.7" and status["podIPs"] == [{"ip": "10.9.8.7"}]
    assert status["hostIP"].startswith("172.18.0.") and status["startTime"]
    [c] = status["containerStatuses"]
    assert c["ready"] is True and c["started"] is True and c["restartCount"] == 0
    assert c["state"]["running"]["startedAt"] and c["lastState"] == {}
    assert c["image"] == "docker.io/library/python:3.11"
    assert c["imageID"].startswith("docker.io/library/python@sha256:")
    assert c["containerID"].startswith("containerd://")
    client.post(PODS, json=pod("b"))
    assert client.get(f"{PODS}/b").json()["status"]["podIP"].startswith("10.244.")


def test_failure_statuses(client: httpx.Client, fake: FakeKube) -> None:
    scripts = {
        "nr": running_not_ready(),
        "us": unschedulable(),
        "ib": image_pull_backoff(),
        "ep": err_image_pull(),
        "cl": crash_loop(2, logs="boom", restarts=3),
        "te": terminated_error(3),
        "oom": oom_killed(),
        "oomcl": oom_killed(restarts=2),
        "cc": create_container_config_error('secret "creds" not found'),
    }
    for name, script in scripts.items():
        fake.set_pod_script(name, script)
        client.post(PODS, json=pod(name, image="ghcr.io/acme/trainer:v1"))
    got = {n: client.get(f"{PODS}/{n}").json() for n in scripts}

    st = got["nr"]["status"]
    ready_cond = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert st["phase"] == "Running" and ready_cond["status"] == "False"
    assert ready_cond["reason"] == "ContainersNotReady"
    assert ready_cond["message"] == "containers with unready status: [main]"

    st = got["us"]["status"]
    assert st["phase"] == "Pending" and "podIP" not in st and "containerStatuses" not in st
    [cond] = st["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == (
        "PodScheduled",
        "False",
        "Unschedulable",
    )
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    assert "nodeName" not in got["us"]["spec"]

    waiting = got["ib"]["status"]["containerStatuses"][0]["state"]["waiting"]
    assert waiting == {
        "reason": "ImagePullBackOff",
        "message": 'Back-off pulling image "ghcr.io/acme/trainer:v1"',
    }
    assert got["ib"]["status"]["phase"] == "Pending" and got["ib"]["status"]["podIP"]
    waiting = got["ep"]["status"]["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == "ErrImagePull"
    assert waiting["message"].startswith(
        "rpc error: code = NotFound desc = failed to pull and "
        'unpack image "ghcr.io/acme/trainer:v1"'
    )

    c = got["cl"]["status"]["containerStatuses"][0]
    assert got["cl"]["status"]["phase"] == "Running" and c["ready"] is False
    assert c["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert c["state"]["waiting"]["message"].startswith(
        "back-off 40s restarting failed container=main pod=cl_default("
    )
    assert c["lastState"]["terminated"]["exitCode"] == 2
    assert c["lastState"]["terminated"]["reason"] == "Error" and c["restartCount"] == 3

    c = got["te"]["status"]["containerStatuses"][0]
    assert c["state"]["terminated"]["reason"] == "Error"
    assert c["state"]["terminated"]["exitCode"] == 3 and c["restartCount"] == 0
    killed = got["oom"]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (killed["reason"], killed["exitCode"]) == ("OOMKilled", 137)
    c = got["oomcl"]["status"]["containerStatuses"][0]
    assert c["lastState"]["terminated"]["reason"] == "OOMKilled" and c["restartCount"] == 2

    assert got["cc"]["status"]["containerStatuses"][0]["state"]["waiting"] == {
        "reason": "CreateContainerConfigError",
        "message": 'secret "creds" not found',
    }

    events = {(e["involvedObject"]["name"], e["reason"]) for e in fake.objects("events")}
    assert {
        ("us", "FailedScheduling"),
        ("ib", "BackOff"),
        ("cl", "BackOff"),
        ("nr", "Scheduled"),
        ("nr", "Started"),
    } <= events
    assert ("us", "Scheduled") not in events
    scheduler = [e for e in fake.objects("events") if e["reason"] == "FailedScheduling"]
    assert scheduler[0]["source"] == {"component": "default-scheduler"}


def test_restart_policy_never_fails_the_pod(client: httpx.Client, fake: FakeKube) -> None:
    fake.set_pod_script("once", terminated_error(1))
    fake.set_pod_script("done", terminated_error(0))
    client.post(PODS, json=pod("once", restartPolicy="Never"))
    client.post(PODS, json=pod("done", restartPolicy="Never"))
    assert client.get(f"{PODS}/once").json()["status"]["phase"] == "Failed"
    done = client.get(f"{PODS}/done").json()["status"]
    assert done["phase"] == "Succeeded"
    assert done["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"


def test_progression_over_time(clock: FakeClock) -> None:
    fake = FakeKube(
        clock=clock,
        pod_behavior=lambda p: [
            (0, unschedulable()),
            (2, container_creating()),
            (5, running_not_ready()),
            (8, ready()),
        ],
    )
    fake.create("pods", "default", pod("a"))
    rvs = []

    def phase() -> tuple[str, bool]:
        p = fake.get("pods", "default", "a")
        rvs.append(p["metadata"]["resourceVersion"])
        ok = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
        return p["status"]["phase"], ok

    assert phase() == ("Pending", False)
    clock.advance(1.9)
    assert phase() == ("Pending", False) and rvs[-1] == rvs[-2]  # nothing changed
    clock.advance(0.1)
    assert phase() == ("Pending", False)
    assert fake.get("pods", "default", "a")["status"]["containerStatuses"][0]["state"] == {
        "waiting": {"reason": "ContainerCreating"}
    }
    clock.advance(3)
    assert phase() == ("Running", False)
    clock.advance(3)
    assert phase() == ("Running", True)
    fake.set_pod_script("a", [(0, crash_loop()), (1, ready())])  # timed from now
    assert phase() == ("Running", False)
    clock.advance(1)
    assert phase() == ("Running", True)


def test_pod_behavior_sees_the_pod(clock: FakeClock) -> None:
    seen: list[str] = []

    def behavior(p: dict) -> object:
        seen.append(p["metadata"]["name"])
        return unschedulable() if p["metadata"]["labels"].get("gpu") else None

    fake = FakeKube(clock=clock, pod_behavior=behavior)
    fake.create("pods", "default", pod("g", {"gpu": "1"}))
    fake.create("pods", "default", pod("c"))
    assert seen == ["g", "c"]
    assert fake.get("pods", "default", "g")["status"]["phase"] == "Pending"
    assert fake.get("pods", "default", "c")["status"]["phase"] == "Running"


# --------------------------------------------------------------------------- logs
def test_logs(client: httpx.Client, fake: FakeKube) -> None:
    client.post(PODS, json=pod("a"))
    fake.set_logs("a", "one\ntwo\nthree\n")
    r = client.get(f"{PODS}/a/log")
    assert r.status_code == 200 and r.text == "one\ntwo\nthree\n"
    assert r.headers["content-type"].startswith("text/plain")
    assert client.get(f"{PODS}/a/log", params={"tailLines": 2}).text == "two\nthree\n"
    assert client.get(f"{PODS}/a/log", params={"tailLines": 0}).text == ""
    body = status_of(client.get(f"{PODS}/a/log", params={"previous": "true"}), 400, "BadRequest")
    assert body["message"] == 'previous terminated container "main" in pod "a" not found'
    assert status_of(client.get(f"{PODS}/nope/log"), 404, "NotFound")

    fake.set_pod_script("c", crash_loop(logs="Traceback...\nValueError: bad\n"))
    client.post(PODS, json=pod("c"))
    prev = client.get(f"{PODS}/c/log", params={"previous": "true"})
    assert prev.text == "Traceback...\nValueError: bad\n"
    assert client.get(f"{PODS}/c/log").text == prev.text  # in back-off: the last run's log
    client.delete(f"{PODS}/c")
    assert status_of(client.get(f"{PODS}/c/log"), 404, "NotFound")


def test_logs_of_pods_that_never_started(client: httpx.Client, fake: FakeKube) -> None:
    fake.set_pod_script("u", unschedulable())
    fake.set_pod_script("i", image_pull_backoff())
    fake.set_pod_script("k", create_container_config_error())
    for name in "uik":
        client.post(PODS, json=pod(name))
    assert client.get(f"{PODS}/u/log").text == ""  # no node: empty, like the real server
    assert (
        status_of(client.get(f"{PODS}/i/log"), 400, "BadRequest")["message"]
        == 'container "main" in pod "i" is waiting to start: trying and failing to pull image'
    )
    assert (
        status_of(client.get(f"{PODS}/k/log"), 400, "BadRequest")["message"]
        == 'container "main" in pod "k" is waiting to start: CreateContainerConfigError'
    )


def test_logs_choose_container(client: httpx.Client, fake: FakeKube) -> None:
    client.post(PODS, json=pod("m", containers=2))
    fake.set_logs("m", "main log\n", container="main")
    fake.set_logs("m", "side log\n", container="side1")
    body = status_of(client.get(f"{PODS}/m/log"), 400, "BadRequest")
    assert (
        body["message"] == "a container name must be specified for pod m, choose one of: "
        "[main side1]"
    )
    assert client.get(f"{PODS}/m/log", params={"container": "side1"}).text == "side log\n"
    assert status_of(client.get(f"{PODS}/m/log", params={"container": "x"}), 400, "BadRequest")


def test_log_script_step_sets_logs(client: httpx.Client, fake: FakeKube) -> None:
    fake.set_pod_script("t", terminated_error(1, logs="fatal: out of cheese\n"))
    client.post(PODS, json=pod("t"))
    assert client.get(f"{PODS}/t/log").text == "fatal: out of cheese\n"


def test_follow_logs(clock: FakeClock) -> None:
    fake = FakeKube(clock=clock, follow_idle_timeout=5.0)
    fake.create("pods", "default", pod("a"))
    fake.create("pods", "default", pod("b"))
    fake.set_logs("a", "first\n")

    def last_words() -> None:
        fake.append_logs("a", "second\n")
        fake.set_pod_script("a", terminated_error(0))

    with httpx.Client(transport=fake, base_url="https://fake-apiserver") as client:
        timer = threading.Timer(0.05, last_words)  # ends when the container stops
        timer.start()
        with client.stream("GET", f"{PODS}/a/log", params={"follow": "true"}) as r:
            assert isinstance(r.stream, httpx.SyncByteStream)
            lines = list(r.iter_lines())
        timer.join()
        assert lines == ["first", "second"]

        fake.set_logs("b", "b1\nb2\n")
        timer = threading.Timer(0.05, client.delete, args=(f"{PODS}/b",))  # ends when pod goes
        timer.start()
        with client.stream("GET", f"{PODS}/b/log", params={"follow": "true", "tailLines": 1}) as r:
            assert r.read() == b"b2\n"
        timer.join()

        fake.follow_idle_timeout = 0.05  # or after a quiet spell
        fake.create("pods", "default", pod("c"))
        fake.set_logs("c", "c1\n")
        assert client.get(f"{PODS}/c/log", params={"follow": "true"}).text == "c1\n"


# --------------------------------------------------------------------------- proxy
def test_proxy_delegates_to_handler(client: httpx.Client, fake: FakeKube) -> None:
    client.post(PODS, json=pod("a"))
    ip = client.get(f"{PODS}/a").json()["status"]["podIP"]
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(207, json={"echo": request.content.decode()}, headers={"x-pod": "a"})

    fake.proxy_handlers[("a", 9000)] = handler
    r = client.post(
        f"{PODS}/a:9000/proxy/call/f",
        params={"x": "1"},
        content=b"payload",
        headers={"x-trace": "t1"},
    )
    assert r.status_code == 207 and r.json() == {"echo": "payload"}
    assert r.headers["x-pod"] == "a"
    [req] = seen
    assert req.method == "POST" and str(req.url) == f"http://{ip}:9000/call/f?x=1"
    assert req.headers["x-trace"] == "t1" and "authorization" not in req.headers

    fake.proxy_handlers[("a", 8000)] = handler  # no port: the first container port
    assert client.get(f"{PODS}/a/proxy/health").status_code == 207
    assert str(seen[-1].url) == f"http://{ip}:8000/health"

    fake.proxy_handlers[("a", 9001)] = lambda request: httpx.Response(
        200, content=iter([b"frame1\n", b"frame2\n"])
    )  # streamed bodies pass through
    with client.stream("GET", f"{PODS}/a:9001/proxy/stream") as r:
        assert list(r.iter_lines()) == ["frame1", "frame2"]


def test_proxy_errors(client: httpx.Client, fake: FakeKube) -> None:
    client.post(PODS, json=pod("a"))
    ip = client.get(f"{PODS}/a").json()["status"]["podIP"]
    body = status_of(client.get(f"{PODS}/a:9000/proxy/x"), 503, "ServiceUnavailable")
    assert body["message"] == (
        f"error trying to reach service: dial tcp {ip}:9000: connect: connection refused"
    )
    assert status_of(client.get(f"{PODS}/nope:9000/proxy/x"), 404, "NotFound")
    fake.set_pod_script("u", unschedulable())
    client.post(PODS, json=pod("u"))
    assert status_of(client.get(f"{PODS}/u:9000/proxy/x"), 400, "BadRequest")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connect: connection reset by peer")

    fake.proxy_handlers[("a", 9000)] = refuse
    assert status_of(client.get(f"{PODS}/a:9000/proxy/x"), 503, "ServiceUnavailable")
    with httpx.Client(transport=fake, base_url="https://fake-apiserver") as anon:
        assert anon.get(f"{PODS}/a:9000/proxy/x").status_code == 401


# --------------------------------------------------------------------------- shapes
def test_objects_match_the_real_openapi_schemas(client: httpx.Client, fake: FakeKube) -> None:
    """Every object the fake hands out validates, in strict mode (no unknown fields), against
    the Kubernetes 1.31 OpenAPI schema."""
    kv = pytest.importorskip("kubernetes_validate")
    scripts = [
        ready(),
        running_not_ready(),
        unschedulable(),
        container_creating(),
        image_pull_backoff(),
        err_image_pull(),
        crash_loop(restarts=7),
        terminated_error(1),
        oom_killed(),
        oom_killed(restarts=1),
        create_container_config_error(),
    ]
    for i, script in enumerate(scripts):
        fake.set_pod_script(f"p{i}", script)
        client.post(PODS, json=pod(f"p{i}", {"i": str(i)}, containers=2))
    body = sts("w", 2)
    body["spec"]["volumeClaimTemplates"] = [
        {
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
    ]
    client.post(STS, json=body)
    client.post(
        "/api/v1/namespaces/default/services",
        json={"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 80}]}},
    )
    client.post(
        "/api/v1/namespaces/default/secrets",
        json={"metadata": {"name": "sec"}, "stringData": {"a": "b"}},
    )
    fake.add_event("p0", "Custom", "hello")
    shapes = [client.delete(f"{PODS}/p0").json(), client.get("/api/v1/namespaces/default").json()]
    for path in (
        PODS,
        STS,
        "/api/v1/namespaces/default/events",
        "/api/v1/namespaces/default/services",
        "/api/v1/namespaces/default/secrets",
        "/api/v1/namespaces/default/persistentvolumeclaims",
    ):
        shapes.append(client.get(path).json())  # the list schema checks every item too
    assert sum(len(s.get("items", ())) for s in shapes) > 40
    for shape in shapes:
        kv.validate(shape, "1.31", strict=True)
