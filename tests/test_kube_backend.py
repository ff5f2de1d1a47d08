"""The Kubernetes backend against the fake API server (``kube_fake.py``), on a fake clock.

No real processes: the backend gets an ``httpx.Client`` over the fake transport and the fake
clock's ``advance`` as its ``sleep``, so launch timeouts and pod termination take no real time.
The last section loads real kubeconfig files and talks to a tiny local HTTP(S) server
(token, context, namespace, TLS with client certificates made by the ``openssl`` CLI).
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import re
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kube_fake as kf
import pytest
from kube_cluster import Cluster as StandIn
from kube_unit import isolate_backend

import ktlite as kt
from ktlite.api.remote import RemoteFunction
from ktlite.backends import kube_deps
from ktlite.backends import kube_manifests as km
from ktlite.backends.base import Plan
from ktlite.backends.kube_api import ClusterInfo, KubeApi, KubeApiError, load
from ktlite.backends.kube_diagnose import diagnose, progress
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.errors import ConfigError, DeployError, LaunchTimeout
from ktlite.modes.deploy import Deployment
from ktlite.specs.deployment_spec import DeploymentSpec

HOST = "https://fake-apiserver"
API_TOKEN = "api-bearer-7f3a"  # the kubeconfig's credential (the fake checks it)
TOKEN = "tok-Sup3rSecret-9b1c2d3e4f"  # the deployment's call token
NAME = "job"


# ---- harness ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_backend(monkeypatch, tmp_path)


class Cluster(StandIn):
    """The stand-in cluster (``kube_cluster``), with this module's credential."""

    api_token = API_TOKEN

    def pods(self) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.fake.objects("pods")}

    def uids(self) -> dict[str, str]:
        return {name: p["metadata"]["uid"] for name, p in self.pods().items()}

    def delete(self, path: str) -> None:
        """Delete an object behind the backend's back."""
        assert self.http.request("DELETE", path).status_code == 200


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(behavior: kf.PodBehavior | None = None, **options: Any) -> Cluster:
        made.append(Cluster(behavior, **options))
        return made[-1]

    yield make
    for cluster in made:
        cluster.http.close()


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()


def spec(
    name: str = NAME, workers: int = 2, port: int | None = None, **compute: Any
) -> DeploymentSpec:
    compute.setdefault("launch_timeout", 60)
    return DeploymentSpec(
        name,
        kt.Compute(backend="kubernetes", **compute)
        .distribute(workers=workers, port=port)
        .pod_spec(),
    )


def only(ordinal: int, bad: kf.PodScript) -> kf.PodBehavior:
    """Pod ``ordinal`` follows ``bad``; the others become ready at once."""
    return lambda pod: bad if pod["metadata"]["name"].endswith(f"-{ordinal}") else kf.ready()


def later(state: kf.PodState, at: float = 3.0) -> kf.PodScript:
    return [(0, kf.pending()), (1, kf.container_creating()), (at, state)]


def _is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod["status"].get("conditions") or []
    )


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# ---- apply -----------------------------------------------------------------------------------


def test_apply_creates_labelled_objects_and_waits_for_ready_pods(cluster: Cluster) -> None:
    s = spec(volumes=(kt.Volume("data", size="1Gi"),))
    applied = cluster.backend.apply(s, TOKEN)

    assert cluster.names("secrets") == [f"{NAME}-token"]
    assert cluster.names("services") == [NAME]
    assert cluster.names("statefulsets") == [NAME]
    assert cluster.names("persistentvolumeclaims") == ["data"]
    service = cluster.fake.get("services", "default", NAME)
    assert service["spec"]["clusterIP"] == "None"  # headless
    for kind in ("secrets", "services", "statefulsets", "persistentvolumeclaims", "pods"):
        for obj in cluster.fake.objects(kind):
            labels = obj["metadata"]["labels"]
            if kube_deps.DEPS_LABEL in labels:  # the namespace's, not the deployment's
                assert labels["app.kubernetes.io/managed-by"] == "ktlite", labels
                continue
            assert labels[km.NAME_LABEL] == NAME, (kind, labels)
            if kind != "pods":
                assert labels["app.kubernetes.io/managed-by"] == "ktlite", (kind, labels)

    pods = cluster.pods()
    assert sorted(pods) == [f"{NAME}-0", f"{NAME}-1"]
    assert all(_is_ready(p) for p in pods.values())
    assert applied.name == NAME and applied.backend == "kubernetes"
    assert [ep.ordinal for ep in applied.endpoints] == [0, 1]
    for ep in applied.endpoints:
        ip = pods[ep.name]["status"]["podIP"]
        assert ep.name == f"{NAME}-{ep.ordinal}"
        assert ep.ip == ip
        assert ep.peer_url == f"https://{ip}:32300"  # pods serve TLS (Compute(tls=None))
        # the API server's proxy to a TLS pod: the https:POD:PORT form
        assert ep.url == f"{HOST}/api/v1/namespaces/default/pods/https:{ep.name}:32300/proxy"
    assert applied.http is cluster.http
    assert applied.token == TOKEN
    assert applied.restarted == [0, 1]
    assert applied.master_port == 29500
    assert not applied.same_host


def test_endpoints_are_ordered_by_ordinal_not_by_name(cluster: Cluster) -> None:
    applied = cluster.backend.apply(spec(workers=12), TOKEN)
    assert [ep.ordinal for ep in applied.endpoints] == list(range(12))
    assert [ep.name for ep in applied.endpoints] == [f"{NAME}-{i}" for i in range(12)]
    assert applied.restarted == list(range(12))
    looked_up = cluster.backend.lookup(NAME)
    assert looked_up is not None
    assert [ep.ordinal for ep in looked_up.endpoints] == list(range(12))


def test_master_port_from_distribute(cluster: Cluster) -> None:
    applied = cluster.backend.apply(spec(port=23456), TOKEN)
    assert applied.master_port == 23456
    looked_up = cluster.backend.lookup(NAME)
    assert looked_up is not None and looked_up.master_port == 23456


def test_out_announces_cluster_once_and_reports_progress(make_cluster) -> None:
    c = make_cluster(lambda pod: [(0, kf.pending()), (2, kf.container_creating()), (4, kf.ready())])
    c.backend.apply(spec(), TOKEN)
    lines = c.out.getvalue().splitlines()
    assert lines[0] == (
        f"ktlite: backend kubernetes, context 'fake-ctx', namespace 'default' ({HOST})"
    )
    assert lines[1:] == [
        f"ktlite: {NAME}: pods scheduled 0/2, running 0/2, ready 0/2",
        f"ktlite: {NAME}: pods scheduled 2/2, running 0/2, ready 0/2",
        f"ktlite: {NAME}: pods scheduled 2/2, running 2/2, ready 2/2",
    ]
    assert 4 <= c.clock() < 10

    # the same API server again (another backend object, another deployment): no new banner
    c.new_backend().apply(spec("other", workers=1), TOKEN)
    assert sum("backend kubernetes" in ln for ln in c.out.getvalue().splitlines()) == 1


# ---- the token -------------------------------------------------------------------------------


def test_token_lives_in_the_secret_only(cluster: Cluster) -> None:
    applied = cluster.backend.apply(spec(), TOKEN)
    secret = cluster.fake.get("secrets", "default", f"{NAME}-token")
    assert secret["data"]["token"] == _b64(TOKEN)
    for kind in ("services", "statefulsets", "pods", "events"):
        text = json.dumps(cluster.fake.objects(kind))
        assert TOKEN not in text and _b64(TOKEN) not in text, kind
    carriers = [(r.method, r.path) for r in cluster.fake.requests if TOKEN.encode() in r.content]
    assert carriers == [("POST", "/api/v1/namespaces/default/secrets")]
    # the pods get it from the Secret as a file, not as a literal value nor an env var
    pod = cluster.fake.get("statefulsets", "default", NAME)["spec"]["template"]["spec"]
    assert {"name": "KTLITE_TOKEN_FILE", "value": "/var/run/ktlite/token/token"} in pod[
        "containers"
    ][0]["env"]
    assert {v["name"]: v for v in pod["volumes"]}["ktlite-token"]["secret"]["secretName"] == (
        f"{NAME}-token"
    )
    assert TOKEN not in cluster.out.getvalue()
    assert TOKEN not in repr(applied) and TOKEN not in str(applied)


def test_token_not_in_error_messages(make_cluster) -> None:
    c = make_cluster(only(1, later(kf.crash_loop(1, logs="starting\nboom\n"))))
    with pytest.raises(DeployError) as err:
        c.backend.apply(spec(), TOKEN)
    assert TOKEN not in str(err.value) and TOKEN not in repr(err.value)

    c2 = make_cluster()
    c2.fake.fail_next("POST", "/secrets$", 422, "Invalid", "Secret is invalid: data")
    with pytest.raises(KubeApiError) as err2:
        c2.backend.apply(spec(), TOKEN)
    assert "Secret" in str(err2.value)
    assert TOKEN not in str(err2.value) and TOKEN not in c2.out.getvalue()


def test_lookup_decodes_the_token_and_returns_the_same_endpoints(cluster: Cluster) -> None:
    applied = cluster.backend.apply(spec(), TOKEN)
    found = cluster.new_backend().lookup(NAME)
    assert found is not None
    assert found.token == TOKEN
    assert found.endpoints == applied.endpoints
    assert found.master_port == applied.master_port
    assert found.http is cluster.http
    assert found.restarted == []
    assert cluster.backend.lookup("missing") is None


# ---- redeploy --------------------------------------------------------------------------------


def test_identical_redeploy_touches_no_pod(cluster: Cluster) -> None:
    s = spec()
    cluster.backend.apply(s, TOKEN)
    before, seen = cluster.uids(), len(cluster.fake.requests)
    again = cluster.new_backend().apply(s, TOKEN)
    assert again.restarted == []
    assert cluster.uids() == before
    assert cluster.fake.find_requests("DELETE", "/pods/") == []
    assert cluster.fake.find_requests("PUT", "/statefulsets/") == []
    assert cluster.fake.find_requests("PATCH", "/statefulsets/") == []
    assert cluster.writes(seen) == []  # nothing written at all


@pytest.mark.parametrize(
    "change",
    [
        {"cpus": 2},
        {"env": {"LR": "0.1"}},
        {"image": "python:3.12-slim"},
    ],
    ids=["cpus", "env", "image"],
)
def test_changed_pod_spec_replaces_every_pod(cluster: Cluster, change: dict[str, Any]) -> None:
    cluster.backend.apply(spec(cpus=1), TOKEN)
    before, seen = cluster.uids(), len(cluster.fake.requests)
    applied = cluster.backend.apply(spec(**{"cpus": 1, **change}), TOKEN)

    assert cluster.fake.find_requests("PUT", f"/statefulsets/{NAME}$")
    # every pod is out of date: one request deletes them all (at any pod count)
    deleted = [(r.path, r.query) for r in cluster.fake.requests[seen:] if r.method == "DELETE"]
    assert deleted == [
        ("/api/v1/namespaces/default/pods", {"labelSelector": f"{km.NAME_LABEL}={NAME}"})
    ], deleted
    after = cluster.uids()
    assert sorted(after) == sorted(before)
    assert all(after[n] != before[n] for n in after)
    want = cluster.fake.get("statefulsets", "default", NAME)["spec"]["template"]["metadata"][
        "annotations"
    ][km.HASH_ANNOTATION]
    assert all(
        p["metadata"]["annotations"][km.HASH_ANNOTATION] == want for p in cluster.pods().values()
    )
    assert applied.restarted == [0, 1]
    assert [ep.name for ep in applied.endpoints] == [f"{NAME}-0", f"{NAME}-1"]


def test_changed_pod_spec_waits_for_old_pods_to_terminate(make_cluster) -> None:
    c = make_cluster(pod_termination_seconds=4)
    c.backend.apply(spec(cpus=1), TOKEN)
    before = c.uids()
    start = c.clock()
    applied = c.backend.apply(spec(cpus=2), TOKEN)
    assert applied.restarted == [0, 1]
    assert c.clock() - start >= 4  # the new pods could only start once the old ones were gone
    assert all(c.uids()[n] != before[n] for n in before)
    assert {ep.ip for ep in applied.endpoints} == {p["status"]["podIP"] for p in c.pods().values()}


def _recreate_after_422(cluster: Cluster) -> tuple[dict[str, str], Any]:
    """Pod uids and the StatefulSet's uid before, and the Applied of a redeploy whose update
    the API server refuses as touching an immutable field (an older ktlite made it)."""
    cluster.backend.apply(spec(cpus=1), TOKEN)
    before = {
        **cluster.uids(),
        "sts": cluster.fake.get("statefulsets", "default", NAME)["metadata"]["uid"],
    }
    cluster.fake.fail_next(
        "PUT",
        f"/statefulsets/{NAME}$",
        422,
        "Invalid",
        'StatefulSet.apps "job" is invalid: spec: Forbidden: updates to '
        "statefulset spec for fields other than ... are forbidden",
    )
    return before, cluster.backend.apply(spec(cpus=2), TOKEN)


def test_statefulset_with_an_immutable_difference_is_recreated(cluster: Cluster) -> None:
    before, applied = _recreate_after_422(cluster)
    assert cluster.fake.get("statefulsets", "default", NAME)["metadata"]["uid"] != before.pop("sts")
    deletes = cluster.fake.find_requests("DELETE", f"/statefulsets/{NAME}$")
    assert [r.body for r in deletes] == [{"propagationPolicy": "Foreground"}]
    assert [
        r.method
        for r in cluster.fake.find_requests(path_regex="/statefulsets")
        if r.method != "GET"
    ] == ["POST", "PUT", "DELETE", "POST"]
    assert all(cluster.uids()[n] != before[n] for n in before)
    assert [ep.ordinal for ep in applied.endpoints] == [0, 1]


def test_recreated_statefulset_reports_every_pod_restarted(cluster: Cluster) -> None:
    _, applied = _recreate_after_422(cluster)
    assert applied.restarted == [0, 1]


def test_objects_created_concurrently_are_fine(cluster: Cluster) -> None:
    cluster.fake.fail_next(
        "POST", "/services$", 409, "AlreadyExists", 'services "job" already exists'
    )
    applied = cluster.backend.apply(spec(), TOKEN)
    assert [ep.ordinal for ep in applied.endpoints] == [0, 1]
    assert cluster.names("statefulsets") == [NAME]


def test_only_workers_changed_scales_up_without_restarts(cluster: Cluster) -> None:
    cluster.backend.apply(spec(workers=2), TOKEN)
    before, seen = cluster.uids(), len(cluster.fake.requests)

    up = cluster.backend.apply(spec(workers=3), TOKEN)
    patches = cluster.fake.find_requests("PATCH", f"/statefulsets/{NAME}$")
    assert [r.body for r in patches] == [{"spec": {"replicas": 3}}]
    assert cluster.fake.find_requests("PUT", "/statefulsets/") == []
    assert [r for r in cluster.fake.requests[seen:] if r.method == "DELETE"] == []
    after = cluster.uids()
    assert sorted(after) == [f"{NAME}-0", f"{NAME}-1", f"{NAME}-2"]
    assert {n: after[n] for n in before} == before
    assert [ep.ordinal for ep in up.endpoints] == [0, 1, 2]
    assert 0 not in up.restarted and 1 not in up.restarted


def test_scale_up_reports_the_new_ordinal_as_restarted(cluster: Cluster) -> None:
    cluster.backend.apply(spec(workers=2), TOKEN)
    assert cluster.backend.apply(spec(workers=3), TOKEN).restarted == [2]


def test_only_workers_changed_scales_down_without_restarts(cluster: Cluster) -> None:
    cluster.backend.apply(spec(workers=3), TOKEN)
    before, seen = cluster.uids(), len(cluster.fake.requests)
    down = cluster.backend.apply(spec(workers=2), TOKEN)
    assert down.restarted == []
    patches = cluster.fake.find_requests("PATCH", f"/statefulsets/{NAME}$")
    assert [r.body for r in patches] == [{"spec": {"replicas": 2}}]
    assert [r for r in cluster.fake.requests[seen:] if r.method == "DELETE"] == []
    assert cluster.uids() == {n: before[n] for n in (f"{NAME}-0", f"{NAME}-1")}  # pod 2 went
    assert [ep.ordinal for ep in down.endpoints] == [0, 1]
    assert cluster.fake.get("statefulsets", "default", NAME)["spec"]["replicas"] == 2
    looked_up = cluster.backend.lookup(NAME)
    assert looked_up is not None and [ep.ordinal for ep in looked_up.endpoints] == [0, 1]


def test_new_token_rolls_every_pod(cluster: Cluster) -> None:
    cluster.backend.apply(spec(), TOKEN)
    before = cluster.uids()
    applied = cluster.backend.apply(spec(), "another-token")
    assert applied.restarted == [0, 1]
    assert all(cluster.uids()[n] != before[n] for n in before)
    assert cluster.fake.get("secrets", "default", f"{NAME}-token")["data"]["token"] == _b64(
        "another-token"
    )
    assert cluster.backend.lookup(NAME).token == "another-token"


def test_secret_missing_but_statefulset_present_rolls_pods(cluster: Cluster) -> None:
    cluster.backend.apply(spec(), TOKEN)
    before = cluster.uids()
    cluster.delete(f"/api/v1/namespaces/default/secrets/{NAME}-token")
    assert cluster.backend.lookup(NAME) is None  # so deploy() draws a new token
    applied = cluster.backend.apply(spec(), "fresh-token")
    assert cluster.fake.get("secrets", "default", f"{NAME}-token")["data"]["token"] == _b64(
        "fresh-token"
    )
    assert applied.restarted == [0, 1]
    assert all(cluster.uids()[n] != before[n] for n in before)


# ---- readiness failures ----------------------------------------------------------------------


def _evicted() -> kf.PodState:
    return kf.PodState(
        lambda ctx: {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: ephemeral-storage.",
            "qosClass": "BestEffort",
            "startTime": ctx.created,
        }
    )


FAILURES = {
    "unschedulable": (
        kf.unschedulable("0/3 nodes are available: 3 Insufficient cpu."),
        ["Unschedulable", "0/3 nodes are available: 3 Insufficient cpu."],
    ),
    "image-pull-backoff": (
        kf.image_pull_backoff("registry.example.com/team/nope:1.0"),
        ["ImagePullBackOff", "registry.example.com/team/nope:1.0", "image_pull_policy"],
    ),
    "err-image-pull": (
        kf.err_image_pull("ghcr.io/example/missing:2"),
        ["ErrImagePull", "ghcr.io/example/missing:2", "image_pull_policy"],
    ),
    "crash-loop": (
        kf.crash_loop(1, logs="loading model\nImportError: No module named 'foo'\n", restarts=3),
        ["CrashLoopBackOff", "exit code 1", "ImportError: No module named 'foo'", "loading model"],
    ),
    "first-exit": (
        kf.terminated_error(3, logs="starting\nfatal: bad flag\n"),
        ["exit code 3", "fatal: bad flag"],
    ),
    "setup-failed": (
        kf.terminated_error(78, logs="ktlite: could not install ktlite==0.1.0\n"),
        ["setup failed", "ktlite: could not install ktlite==0.1.0"],
    ),
    "oom": (kf.oom_killed(), ["OOMKilled", "memory"]),
    "config-error": (
        kf.create_container_config_error('secret "hf-token" not found'),
        ["CreateContainerConfigError", 'secret "hf-token" not found'],
    ),
    "evicted": (_evicted(), ["failed", "Evicted", "low on resource"]),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_pod_that_cannot_start_fails_early_naming_pod_and_reason(make_cluster, case: str) -> None:
    state, expected = FAILURES[case]
    c = make_cluster(only(1, later(state)))
    with pytest.raises(DeployError) as err:
        c.backend.apply(spec(launch_timeout=600), TOKEN)
    message = str(err.value)
    assert not isinstance(err.value, LaunchTimeout)
    assert f"pod {NAME}-1" in message, message
    assert f"{NAME}-0:" not in message
    for text in expected:
        assert text in message, (text, message)
    assert 3 <= c.clock() < 10  # waited for the failure, then stopped at once
    assert TOKEN not in message


PIP_ERROR = "ERROR: No matching distribution found for torch==9.9"


def test_setup_failure_shows_the_current_log_when_the_previous_one_is_lost(make_cluster) -> None:
    # as seen on a real cluster: the run before was removed from the runtime, so the kubelet
    # answers for its log with 200 and a line of its own; the pip error is in this run's log
    lost = kf.terminated_again(
        km.SETUP_FAILED_EXIT,
        logs=f"ktlite: installing torch==9.9\n{PIP_ERROR}\n",
        previous_log_lost=True,
    )
    c = make_cluster(only(1, later(lost)))
    with pytest.raises(DeployError) as err:
        c.backend.apply(spec(launch_timeout=600), TOKEN)
    message = str(err.value)
    assert "setup failed" in message and f"pod {NAME}-1" in message, message
    assert f"last lines of its log:\n    ktlite: installing torch==9.9\n    {PIP_ERROR}" in message
    assert "unable to retrieve" not in message


def test_setup_failure_shows_both_logs_when_both_have_text(make_cluster) -> None:
    twice = kf.terminated_again(
        km.SETUP_FAILED_EXIT,
        logs=f"second try\n{PIP_ERROR}\n",
        previous_logs="first try\nERROR: network is unreachable\n",
    )
    c = make_cluster(only(1, later(twice)))
    with pytest.raises(DeployError) as err:
        c.backend.apply(spec(launch_timeout=600), TOKEN)
    message = str(err.value)
    previous = message.index(
        "last lines of the previous container's log:\n    first try\n"
        "    ERROR: network is unreachable"
    )
    current = message.index(
        f"last lines of the current container's log:\n    second try\n    {PIP_ERROR}"
    )
    assert previous < current, message


@pytest.mark.parametrize("runtime", ["containerd", "docker", "cri-o"])
def test_pod_log_treats_the_kubelets_lost_log_line_as_no_log(make_cluster, runtime: str) -> None:
    c = make_cluster(
        lambda pod: kf.terminated_again(1, logs="the real log\n", previous_log_lost=True)
    )
    c.fake.create(
        "pods",
        "default",
        {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "ktlite", "image": "img"}]}},
    )
    if runtime != "containerd":  # the fake's runtime; the kubelet words the others alike
        c.fake.set_logs(
            "p",
            f"unable to retrieve container logs for {runtime}://{'ab' * 32}",
            previous=True,
            container="ktlite",
        )
    raw = c.http.get(
        "/api/v1/namespaces/default/pods/p/log", params={"container": "ktlite", "previous": "true"}
    )
    assert raw.status_code == 200
    assert re.fullmatch(
        rf"unable to retrieve container logs for {runtime}://[0-9a-f]{{64}}", raw.text
    )
    api = KubeApi(c.http, "default")
    assert api.pod_log("p", previous=True) == ""
    assert api.pod_log("p") == "the real log\n"


def test_unschedulable_while_autoscaler_adds_a_node_keeps_waiting(make_cluster) -> None:
    c = make_cluster(lambda pod: kf.unschedulable())
    for i in range(2):
        c.fake.add_event(
            f"{NAME}-{i}",
            "TriggeredScaleUp",
            "pod triggered scale-up: [{gpu-pool 0->1 (max: 4)}]",
            "Normal",
            component="cluster-autoscaler",
        )
    with pytest.raises(LaunchTimeout) as err:
        c.backend.apply(spec(launch_timeout=30), TOKEN)
    message = str(err.value)
    assert "autoscaler" in message and "Unschedulable" in message
    assert "launch_timeout=30" in message and "ready 0/2" in message
    assert 30 <= c.clock() < 35
    assert isinstance(err.value, TimeoutError)


def test_running_but_never_ready_times_out_with_last_reason(make_cluster) -> None:
    c = make_cluster(lambda pod: [(0, kf.container_creating()), (2, kf.running_not_ready())])
    with pytest.raises(LaunchTimeout) as err:
        c.backend.apply(spec(launch_timeout=25), TOKEN)
    message = str(err.value)
    assert "ready 0/2" in message and "running 2/2" in message
    assert "waiting for the server to answer /health" in message
    assert f"{NAME}-0" in message  # the describe hint names a pod
    assert 25 <= c.clock() < 30


def _recovered(ready: bool) -> kf.PodState:
    """Crashed once (lastState.terminated, exit 1) but running again."""

    def status(ctx: kf.PodCtx) -> dict[str, Any]:
        name, image = ctx.containers[0]
        cond = [
            {"type": t, "status": "True" if ok else "False"}
            for t, ok in (
                ("PodScheduled", True),
                ("Initialized", True),
                ("ContainersReady", ready),
                ("Ready", ready),
            )
        ]
        return {
            "phase": "Running",
            "podIP": ctx.ip,
            "podIPs": [{"ip": ctx.ip}],
            "hostIP": ctx.host_ip,
            "conditions": cond,
            "containerStatuses": [
                {
                    "name": name,
                    "image": image,
                    "ready": ready,
                    "restartCount": 1,
                    "started": True,
                    "state": {"running": {"startedAt": ctx.since}},
                    "lastState": {
                        "terminated": {
                            "exitCode": 1,
                            "reason": "Error",
                            "startedAt": ctx.created,
                            "finishedAt": ctx.since,
                        }
                    },
                }
            ],
        }

    return kf.PodState(status)


def test_container_running_again_after_a_crash_is_not_a_crash(make_cluster) -> None:
    c = make_cluster(lambda pod: [(0, _recovered(False)), (5, _recovered(True))])
    applied = c.backend.apply(spec(), TOKEN)
    assert [ep.ordinal for ep in applied.endpoints] == [0, 1]
    assert 5 <= c.clock() < 10


# ---- API errors ------------------------------------------------------------------------------


def test_forbidden_names_status_message_and_rbac_hint(cluster: Cluster) -> None:
    cluster.fake.fail_next(
        "POST",
        "statefulsets",
        403,
        "Forbidden",
        'statefulsets.apps is forbidden: User "dev" cannot create resource '
        '"statefulsets" in API group "apps" in the namespace "default"',
    )
    with pytest.raises(KubeApiError) as err:
        cluster.backend.apply(spec(), TOKEN)
    assert isinstance(err.value, DeployError)
    assert err.value.status == 403 and err.value.reason == "Forbidden"
    message = str(err.value)
    assert "403" in message and "Forbidden" in message
    assert 'User "dev" cannot create resource "statefulsets"' in message
    assert "RBAC" in message and "'default'" in message
    assert TOKEN not in message


def test_unknown_namespace_names_it(make_cluster) -> None:
    c = make_cluster(namespace="team-x")
    with pytest.raises(KubeApiError) as err:
        c.backend.apply(spec(), TOKEN)
    message = str(err.value)
    assert err.value.status == 404
    assert "404" in message and 'namespaces "team-x" not found' in message
    assert "does namespace 'team-x' exist?" in message


def test_refused_credentials_say_log_in_again(cluster: Cluster) -> None:
    with httpx.Client(
        transport=cluster.fake, base_url=HOST, headers={"authorization": "Bearer expired"}
    ) as client:
        backend = KubernetesBackend(
            client, cluster.info, out=cluster.out, clock=cluster.clock, sleep=cluster.clock.advance
        )
        with pytest.raises(KubeApiError) as err:
            backend.list()
    assert err.value.status == 401
    assert "401" in str(err.value) and "log in again" in str(err.value)
    assert "expired" not in str(err.value)


def test_error_without_a_status_body() -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="<html>bad gateway from the load balancer</html>")

    with (
        httpx.Client(transport=httpx.MockTransport(gateway), base_url=HOST) as client,
        pytest.raises(KubeApiError) as err,
    ):
        KubeApi(client, "default").list("Pod")
    assert err.value.status == 502
    assert "HTTP 502" in str(err.value) and "bad gateway from the load balancer" in str(err.value)


def test_unreachable_api_server(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    clock = kf.FakeClock()
    with httpx.Client(transport=httpx.MockTransport(refuse), base_url=HOST) as client:
        backend = KubernetesBackend(
            client,
            ClusterInfo(HOST, "ctx", "default", False),
            out=io.StringIO(),
            clock=clock,
            sleep=clock.advance,
        )
        with pytest.raises(KubeApiError) as err:
            backend.apply(spec(), TOKEN)
        assert "could not reach the Kubernetes API server" in str(err.value)
        assert HOST in str(err.value) and "Connection refused" in str(err.value)
        assert TOKEN not in str(err.value)
        with pytest.raises(KubeApiError, match="could not reach"):
            backend.list()


# ---- teardown --------------------------------------------------------------------------------


def test_teardown_deletes_everything_but_volumes_and_waits_for_pods(make_cluster) -> None:
    c = make_cluster(pod_termination_seconds=3)
    c.backend.apply(spec(volumes=(kt.Volume("data", size="1Gi"),)), TOKEN)
    start = c.clock()
    assert c.backend.teardown(NAME) is True
    assert c.clock() - start >= 3  # polled (on the fake clock) until the pods were gone
    assert c.names("pods") == []
    for kind in ("statefulsets", "services", "secrets"):
        assert c.names(kind) == [], kind
    assert c.names("persistentvolumeclaims") == ["data"]
    for path in (f"/statefulsets/{NAME}$", f"/services/{NAME}$", f"/secrets/{NAME}-token$"):
        assert c.fake.find_requests("DELETE", path), path
    assert c.backend.teardown(NAME) is False  # already gone
    assert c.backend.lookup(NAME) is None


def test_teardown_with_volumes_deletes_the_claims(cluster: Cluster) -> None:
    cluster.backend.apply(spec(volumes=(kt.Volume("data", size="1Gi"),)), TOKEN)
    assert cluster.backend.teardown(NAME, volumes=True) is True
    assert cluster.names("persistentvolumeclaims") == []
    assert cluster.names("pods") == []


def _handle(cluster: Cluster, s: DeploymentSpec) -> RemoteFunction:
    """What ``kt.fn(...).to()`` returns, over the fake (no code pushed: no pod runs a server)."""
    return RemoteFunction(
        kt.fn(lambda: None, name=s.name),
        Deployment(s, cluster.backend, cluster.backend.apply(s, TOKEN)),
    )


def test_teardown_then_teardown_with_volumes_on_one_handle_deletes_the_claims(
    cluster: Cluster,
) -> None:
    remote = _handle(cluster, spec(volumes=(kt.Volume("data", size="1Gi"),)))
    remote.teardown()
    assert cluster.names("persistentvolumeclaims") == ["data"]
    assert cluster.names("statefulsets") == [] and cluster.names("pods") == []
    remote.teardown()  # a second plain teardown is harmless, and still keeps the volume
    assert cluster.names("persistentvolumeclaims") == ["data"]

    remote.teardown(volumes=True)
    assert cluster.names("persistentvolumeclaims") == []
    assert (
        len(cluster.fake.find_requests("DELETE", "/persistentvolumeclaims$")) == 1
    )  # one collection
    remote.teardown(volumes=True)  # nothing left to do
    assert len(cluster.fake.find_requests("DELETE", "/persistentvolumeclaims$")) == 1


def test_teardown_volumes_on_a_torn_down_handle_spares_a_new_deployment(cluster: Cluster) -> None:
    s = spec(volumes=(kt.Volume("data", size="1Gi"),))
    old = _handle(cluster, s)
    old.teardown()
    cluster.backend.apply(s, TOKEN)  # the same name, deployed again (another .to())
    with pytest.raises(kt.NotDeployedError, match="deployed again") as err:
        old.teardown(volumes=True)
    assert f"ktlite teardown {NAME} --volumes --backend kubernetes" in str(err.value)
    assert cluster.names("persistentvolumeclaims") == ["data"]
    assert cluster.names("statefulsets") == [NAME]
    assert sorted(cluster.names("pods")) == [f"{NAME}-0", f"{NAME}-1"]


def test_teardown_tolerates_objects_deleted_behind_its_back(cluster: Cluster) -> None:
    cluster.backend.apply(spec(), TOKEN)
    cluster.delete(f"/api/v1/namespaces/default/services/{NAME}")
    assert cluster.backend.teardown(NAME) is True
    for kind in ("statefulsets", "services", "secrets", "pods"):
        assert cluster.names(kind) == [], kind


def test_teardown_of_a_pod_that_never_goes_names_it(make_cluster) -> None:
    c = make_cluster(pod_termination_seconds=3600)  # capped by the 15 s grace period
    c.backend.apply(spec(workers=1), TOKEN)
    with pytest.raises(DeployError) as err:
        c.backend.teardown(NAME, timeout=5)
    assert f"{NAME}-0" in str(err.value) and "5s" in str(err.value)
    assert c.clock() < 15


# ---- list / logs -----------------------------------------------------------------------------


def test_list_shows_one_row_per_managed_statefulset(make_cluster, monkeypatch) -> None:
    c = make_cluster(only(1, kf.running_not_ready()))
    c.backend.apply(spec("alpha", workers=1), TOKEN)
    monkeypatch.setenv("KTLITE_KEEP_FAILED", "true")  # a half-ready deployment, kept
    with pytest.raises(LaunchTimeout):
        c.backend.apply(spec("beta", workers=2, launch_timeout=5), TOKEN)
    c.fake.create(
        "statefulsets",
        "default",
        {  # not ktlite's
            "metadata": {"name": "db", "labels": {"app": "db"}},
            "spec": {
                "selector": {"matchLabels": {"app": "db"}},
                "replicas": 0,
                "template": {
                    "metadata": {"labels": {"app": "db"}},
                    "spec": {"containers": [{"name": "db", "image": "postgres:16"}]},
                },
            },
        },
    )
    rows = sorted(c.backend.list(), key=lambda r: r["name"])
    assert [(r["name"], r["backend"], r["namespace"], r["pods"], r["ready"]) for r in rows] == [
        ("alpha", "kubernetes", "default", 1, 1),
        ("beta", "kubernetes", "default", 2, 1),
    ]


def test_logs_prefix_every_line_with_its_pod_in_ordinal_order(cluster: Cluster) -> None:
    cluster.backend.apply(spec(workers=11), TOKEN)
    cluster.fake.set_logs(f"{NAME}-2", "two a\ntwo b\n")
    cluster.fake.set_logs(f"{NAME}-10", "ten a\nten b\nten c\n")
    assert list(cluster.backend.logs(NAME)) == [
        f"[{NAME}-2] two a",
        f"[{NAME}-2] two b",
        f"[{NAME}-10] ten a",
        f"[{NAME}-10] ten b",
        f"[{NAME}-10] ten c",
    ]
    assert list(cluster.backend.logs(NAME, ordinal=10)) == [
        f"[{NAME}-10] ten a",
        f"[{NAME}-10] ten b",
        f"[{NAME}-10] ten c",
    ]
    assert list(cluster.backend.logs(NAME, ordinal=10, tail=1)) == [f"[{NAME}-10] ten c"]
    assert list(cluster.backend.logs(NAME, tail=1)) == [f"[{NAME}-2] two b", f"[{NAME}-10] ten c"]
    tails = [r.query.get("tailLines") for r in cluster.fake.find_requests("GET", "/log$")]
    assert tails[-11:] == ["1"] * 11


def test_logs_follow_one_pod_streams_new_lines(make_cluster) -> None:
    c = make_cluster(follow_idle_timeout=0.3)
    c.backend.apply(spec(workers=2), TOKEN)
    c.fake.set_logs(f"{NAME}-1", "first\n")
    stream = c.backend.logs(NAME, ordinal=1, follow=True)
    assert next(stream) == f"[{NAME}-1] first"
    c.fake.append_logs(f"{NAME}-1", "second\nthird\n")
    assert list(stream) == [f"[{NAME}-1] second", f"[{NAME}-1] third"]  # ends when idle
    assert c.fake.find_requests("GET", f"/pods/{NAME}-1/log$")[-1].query["follow"] == "true"


def test_logs_follow_all_pods_merges_them(make_cluster) -> None:
    c = make_cluster(follow_idle_timeout=0.2)
    c.backend.apply(spec(workers=2), TOKEN)
    c.fake.set_logs(f"{NAME}-0", "zero\n")
    c.fake.set_logs(f"{NAME}-1", "one\n")
    assert sorted(c.backend.logs(NAME, follow=True)) == [f"[{NAME}-0] zero", f"[{NAME}-1] one"]


def test_logs_of_a_missing_deployment(cluster: Cluster) -> None:
    with pytest.raises(DeployError, match="no deployment 'nope'"):
        list(cluster.backend.logs("nope"))
    cluster.backend.apply(spec(workers=1), TOKEN)
    with pytest.raises(DeployError, match=f"no pod 3 of deployment '{NAME}'"):
        list(cluster.backend.logs(NAME, ordinal=3))


# ---- in-cluster ------------------------------------------------------------------------------


def test_in_cluster_uses_pod_ips_directly(make_cluster) -> None:
    c = make_cluster(in_cluster=True)
    applied = c.backend.apply(spec(), TOKEN)
    assert applied.http is None
    for ep in applied.endpoints:
        assert ep.url == ep.peer_url == f"https://{ep.ip}:32300"  # TLS, pinned
    found = c.backend.lookup(NAME)
    assert found is not None and found.http is None and found.endpoints == applied.endpoints


def test_ipv6_pod_ips_are_bracketed(make_cluster) -> None:
    ips = iter(["fd00:10:244::5", "fd00:10:244::6"])
    c = make_cluster(lambda pod: kf.ready(ip=next(ips)), in_cluster=True)
    applied = c.backend.apply(spec(), TOKEN)
    assert [ep.ip for ep in applied.endpoints] == ["fd00:10:244::5", "fd00:10:244::6"]
    assert [ep.url for ep in applied.endpoints] == [
        "https://[fd00:10:244::5]:32300",
        "https://[fd00:10:244::6]:32300",
    ]
    assert applied.endpoints[0].peer_url == "https://[fd00:10:244::5]:32300"


# ---- plan ------------------------------------------------------------------------------------


def plan_me(x: int) -> int:
    return x + 1


def test_plan_reads_no_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    backend = KubernetesBackend(namespace="team-a")
    plan = backend.plan(spec(volumes=(kt.Volume("data", size="1Gi"),)))
    assert isinstance(plan, Plan) and plan.backend == "kubernetes" and plan.name == NAME
    assert [m["kind"] for m in plan.manifests] == [
        "Secret",
        "Service",
        "PersistentVolumeClaim",
        "NetworkPolicy",
        "StatefulSet",
    ]
    assert all(m["metadata"]["namespace"] == "team-a" for m in plan.manifests)
    assert plan.manifests[0]["stringData"]["token"] == km.TOKEN_PLACEHOLDER
    assert KubernetesBackend._clients == {}  # never loaded a kubeconfig

    remote_plan = kt.fn(plan_me).to(
        kt.Compute(backend="kubernetes", namespace="team-a"), dryrun=True
    )
    assert isinstance(remote_plan, Plan)
    assert remote_plan.name == "plan-me"
    assert {m["metadata"]["namespace"] for m in remote_plan.manifests} == {"team-a"}
    assert "namespace: team-a" in str(remote_plan)
    assert KubernetesBackend._clients == {}


def test_plan_namespace_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    assert {m["metadata"]["namespace"] for m in KubernetesBackend().plan(spec()).manifests} == {
        "default"
    }
    monkeypatch.setenv("KTLITE_NAMESPACE", "from-env")
    assert {m["metadata"]["namespace"] for m in KubernetesBackend().plan(spec()).manifests} == {
        "from-env"
    }


# ---- diagnose / progress (pure) --------------------------------------------------------------


def _pod(status: dict[str, Any], name: str = "p-0") -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


def test_diagnose_hand_written_statuses() -> None:
    assert diagnose(_pod({})) is None
    waiting = diagnose(_pod({"phase": "Pending"}))
    assert waiting is not None and not waiting.fatal
    assert "waiting to be scheduled" in waiting.message

    crash = diagnose(
        _pod(
            {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "ktlite",
                        "restartCount": 4,
                        "state": {
                            "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}
                        },
                        "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}},
                    }
                ],
            }
        )
    )
    assert crash is not None and crash.fatal and crash.want_logs
    assert "exit code 2" in crash.message and "4 restart(s)" in crash.message

    recovered = diagnose(
        _pod(
            {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "ktlite",
                        "restartCount": 1,
                        "state": {"running": {}},
                        "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                    }
                ],
            }
        )
    )
    assert recovered is not None and not recovered.fatal
    assert "OOMKilled" not in recovered.message

    unschedulable = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    fatal = diagnose(_pod(unschedulable))
    assert fatal is not None and fatal.fatal and "Insufficient nvidia.com/gpu" in fatal.message
    assert fatal.fix
    scaling = diagnose(_pod(unschedulable), scaling_up=lambda p: True)
    assert scaling is not None and not scaling.fatal and "autoscaler" in scaling.message

    setup = diagnose(
        _pod(
            {
                "phase": "Running",
                "containerStatuses": [
                    {"name": "ktlite", "state": {"terminated": {"exitCode": km.SETUP_FAILED_EXIT}}}
                ],
            }
        )
    )
    assert setup is not None and setup.fatal and "setup failed" in setup.message

    failed = diagnose(_pod({"phase": "Failed", "reason": "Evicted", "message": "low memory"}))
    assert failed is not None and failed.fatal and failed.message.endswith("Evicted low memory")


def test_progress_counts() -> None:
    def st(scheduled: bool, phase: str, ready: bool) -> dict[str, Any]:
        return _pod(
            {
                "phase": phase,
                "conditions": [
                    {"type": "PodScheduled", "status": str(scheduled)},
                    {"type": "Ready", "status": str(ready)},
                ],
            }
        )

    pods = [st(True, "Running", True), st(True, "Running", False), st(True, "Pending", False)]
    assert progress(pods, 4) == "pods scheduled 3/4, running 2/4, ready 1/4"
    assert progress([], 2) == "pods scheduled 0/2, running 0/2, ready 0/2"
    assert progress([_pod({})], 1) == "pods scheduled 0/1, running 0/1, ready 0/1"


# ---- kubeconfig loading ----------------------------------------------------------------------


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def write_kubeconfig(
    path: Path,
    clusters: dict[str, dict[str, Any]],
    users: dict[str, dict[str, Any]],
    contexts: dict[str, dict[str, Any]],
    current: str,
) -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": current,
        "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
        "users": [{"name": n, "user": u} for n, u in users.items()],
        "contexts": [{"name": n, "context": c} for n, c in contexts.items()],
    }
    path.write_text(json.dumps(doc, indent=2))  # JSON is YAML
    return str(path)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _ApiServer

    def do_GET(self) -> None:  # noqa: N802
        self.server.seen.append((self.path, self.headers.get("authorization")))
        m = re.fullmatch(r"/(api/v1|apis/apps/v1)/namespaces/[^/?]+/\w+(\?.*)?", self.path)
        if m is None:
            code, body = (
                404,
                {
                    "kind": "Status",
                    "status": "Failure",
                    "code": 404,
                    "reason": "NotFound",
                    "message": "not found",
                },
            )
        else:
            code, body = (
                200,
                {
                    "kind": "List",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": "1"},
                    "items": [],
                },
            )
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ApiServer(http.server.ThreadingHTTPServer):
    """Answers ``GET /api/v1/namespaces/NS/KIND`` (or apps/v1) with an empty list; optional TLS
    (the handshake runs in the handler thread, bounded by a socket timeout)."""

    daemon_threads = True

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.tls = tls
        self.seen: list[tuple[str, str | None]] = []
        self.handshake_errors: list[str] = []
        self.thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.server_address[1]}"

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        sock.settimeout(10)
        return sock, addr

    def finish_request(self, request: Any, client_address: Any) -> None:
        conn = request
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(request, server_side=True)
            except OSError as e:  # ssl.SSLError too
                self.handshake_errors.append(str(e))
                return
        try:
            self.RequestHandlerClass(conn, client_address, self)
        finally:
            if conn is not request:
                conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass

    def __enter__(self) -> _ApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


def test_load_token_kubeconfig_sends_bearer_and_uses_context_namespace(
    tmp_path: Path, no_proxy: None
) -> None:
    with _ApiServer() as server:
        path = write_kubeconfig(
            tmp_path / "config",
            clusters={"dev": {"server": server.url}, "prod": {"server": "https://10.0.0.1:6443"}},
            users={"alice": {"token": "alice-token-123"}, "bob": {"token": "bob-token-456"}},
            contexts={
                "dev-ctx": {"cluster": "dev", "user": "alice", "namespace": "team-a"},
                "prod-ctx": {"cluster": "prod", "user": "bob", "namespace": "team-b"},
                "bare": {"cluster": "dev", "user": "alice"},
            },
            current="dev-ctx",
        )
        client, info = load(path)
        with client:
            assert info == ClusterInfo(server.url, "dev-ctx", "team-a", False)
            assert KubeApi(client, info.namespace).list("Pod") == []
            assert server.seen == [
                ("/api/v1/namespaces/team-a/pods?limit=500", "Bearer alice-token-123")
            ]
            # the auth object renews the header per request and never shows the token
            request = client.build_request("GET", "/api/v1/namespaces/team-a/pods")
            assert (
                next(client.auth.auth_flow(request)).headers["authorization"]
                == "Bearer alice-token-123"
            )
            assert "alice-token-123" not in repr(client.auth)
            assert "alice-token-123" not in repr(KubeApi(client, "team-a"))

        other, other_info = load(path, context="prod-ctx")
        with other:
            assert other_info == ClusterInfo("https://10.0.0.1:6443", "prod-ctx", "team-b", False)
            request = other.build_request("GET", "/api/v1/namespaces/team-b/pods")
            assert (
                next(other.auth.auth_flow(request)).headers["authorization"]
                == "Bearer bob-token-456"
            )

        bare, bare_info = load(path, context="bare")
        bare.close()
        assert bare_info.namespace == "default" and bare_info.context == "bare"
        explicit, explicit_info = load(path, namespace="elsewhere")
        explicit.close()
        assert explicit_info.namespace == "elsewhere"


def test_load_missing_kubeconfig_names_path_and_kubeconfig(tmp_path: Path, no_proxy: None) -> None:
    missing = str(tmp_path / "does-not-exist.yaml")
    with pytest.raises(ConfigError) as err:
        load(missing)
    assert missing in str(err.value) and "KUBECONFIG" in str(err.value)


def test_load_unknown_context_names_it(tmp_path: Path, no_proxy: None) -> None:
    path = write_kubeconfig(
        tmp_path / "config",
        clusters={"c": {"server": "https://127.0.0.1:1"}},
        users={"u": {"token": "x"}},
        contexts={"a": {"cluster": "c", "user": "u"}},
        current="a",
    )
    with pytest.raises(ConfigError) as err:
        load(path, context="nope")
    assert "'nope'" in str(err.value) and path in str(err.value)


def test_kubernetes_backend_loads_the_configured_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_proxy: None
) -> None:
    with _ApiServer() as server:
        path = write_kubeconfig(
            tmp_path / "config",
            clusters={"c": {"server": server.url}},
            users={"u": {"token": "cfg-token"}},
            contexts={"a": {"cluster": "c", "user": "u", "namespace": "ns-a"}},
            current="a",
        )
        monkeypatch.setenv("KTLITE_KUBECONFIG", path)
        backend = KubernetesBackend()
        assert backend.namespace == "ns-a"
        assert backend.list() == []
        assert (
            "/apis/apps/v1/namespaces/ns-a/statefulsets?labelSelector=app.kubernetes.io%2Fmanaged-by%3Dktlite&limit=500",
            "Bearer cfg-token",
        ) in server.seen  # then the served deployments' kinds
        for client, _ in KubernetesBackend._clients.values():
            client.close()


# ---- TLS -------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=ktlite-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )
    for who, usage, san in (
        ("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "clientAuth", ""),
    ):
        _openssl(
            "req",
            "-new",
            *ec,
            "-keyout",
            f"{who}.key",
            "-out",
            f"{who}.csr",
            "-subj",
            f"/CN=ktlite-test-{who}" + ("/O=system:masters" if who == "client" else ""),
            cwd=d,
        )
        ext = [
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature",
            f"extendedKeyUsage={usage}",
            "subjectKeyIdentifier=hash",
            "authorityKeyIdentifier=keyid",
        ] + ([san] if san else [])
        (d / f"{who}.ext").write_text("\n".join(ext) + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-set_serial",
            "2" if who == "server" else "3",
            "-days",
            "2",
            "-out",
            f"{who}.crt",
            "-extfile",
            f"{who}.ext",
            cwd=d,
        )
    return d


def _server_tls(pki: Path, require_client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki / "server.crt", pki / "server.key")
    if require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki / "ca.crt")
    return ctx


def _tls_kubeconfig(
    tmp_path: Path, server: str, cluster: dict[str, Any], user: dict[str, Any]
) -> str:
    return write_kubeconfig(
        tmp_path / "config",
        clusters={"tls": {"server": server, **cluster}},
        users={"u": user},
        contexts={"tls-ctx": {"cluster": "tls", "user": "u"}},
        current="tls-ctx",
    )


def _file_or_data(pki: Path, inline: bool, key: str, file: str) -> dict[str, str]:
    if inline:
        return {f"{key}-data": base64.b64encode((pki / file).read_bytes()).decode()}
    return {key: str(pki / file)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inline", [False, True], ids=["files", "data"])
def test_client_certificate_kubeconfig_over_real_tls(
    pki: Path, tmp_path: Path, no_proxy: None, inline: bool
) -> None:
    with _ApiServer(_server_tls(pki, require_client_cert=True)) as server:
        ca = _file_or_data(pki, inline, "certificate-authority", "ca.crt")
        good = _tls_kubeconfig(
            tmp_path,
            server.url,
            ca,
            {
                **_file_or_data(pki, inline, "client-certificate", "client.crt"),
                **_file_or_data(pki, inline, "client-key", "client.key"),
            },
        )
        client, info = load(good)
        with client:
            assert info.namespace == "default"
            assert KubeApi(client, info.namespace).list("Pod") == []
        assert server.seen == [("/api/v1/namespaces/default/pods?limit=500", None)]

        no_cert = _tls_kubeconfig(tmp_path, server.url, ca, {"token": "not-enough"})
        client, info = load(no_cert)
        with client, pytest.raises(KubeApiError) as err:
            KubeApi(client, info.namespace).list("Pod")
        assert "could not reach the Kubernetes API server" in str(err.value)
        assert "not-enough" not in str(err.value)
        assert len(server.seen) == 1  # the request never got through
        deadline = time.monotonic() + 5
        while not server.handshake_errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.handshake_errors  # the server refused the handshake


@pytest.mark.timeout(60)
def test_server_certificate_is_verified_unless_insecure_skip_tls_verify(
    pki: Path, tmp_path: Path, no_proxy: None
) -> None:
    with _ApiServer(_server_tls(pki, require_client_cert=False)) as server:
        unverified = _tls_kubeconfig(tmp_path, server.url, {}, {"token": "tok-a"})
        client, info = load(unverified)  # no CA: the server's certificate is not trusted
        with client, pytest.raises(KubeApiError, match="could not reach"):
            KubeApi(client, info.namespace).list("Pod")
        assert server.seen == []

        insecure = _tls_kubeconfig(
            tmp_path, server.url, {"insecure-skip-tls-verify": True}, {"token": "tok-a"}
        )
        client, info = load(insecure)
        with client:
            assert KubeApi(client, info.namespace).list("Pod") == []
        assert server.seen == [("/api/v1/namespaces/default/pods?limit=500", "Bearer tok-a")]


# ---- issue 9: volumes that bind late or never, failed deploys rolled back -----------------------


def test_a_volume_that_binds_late_is_waited_for(make_cluster) -> None:
    c = make_cluster(pvc_bind_seconds=6)
    applied = c.backend.apply(spec(volumes=(kt.Volume("data", size="1Gi"),)), TOKEN)
    assert [ep.name for ep in applied.endpoints] == [f"{NAME}-0", f"{NAME}-1"]
    assert 6 <= c.clock() < 10, "the deploy must wait for the claim to bind, then go on at once"
    assert c.fake.get("persistentvolumeclaims", "default", "data")["status"]["phase"] == "Bound"


def test_a_volume_that_cannot_bind_fails_with_the_reason_and_is_rolled_back(make_cluster) -> None:
    c = make_cluster()
    volume = kt.Volume("data", size="1Gi", storage_class="does-not-exist-sc")
    with pytest.raises(DeployError) as err:
        c.backend.apply(spec(volumes=(volume,), launch_timeout=300), TOKEN)
    message = str(err.value)
    assert 'storageclass.storage.k8s.io "does-not-exist-sc" not found' in message, message
    assert "volume cannot be bound" in message and "storage_class" in message, message
    assert c.clock() < 5, "a claim that cannot bind must fail the deploy at once"
    assert "removed what this deploy had created" in message, message
    for kind in ("statefulsets", "services", "secrets", "persistentvolumeclaims", "pods"):
        assert c.names(kind) == [], kind


def test_a_failed_first_deploy_removes_what_it_created(make_cluster) -> None:
    c = make_cluster(only(1, kf.unschedulable()))  # pod 0 runs (and would hold its CPUs)
    with pytest.raises(DeployError) as err:
        c.backend.apply(spec(volumes=(kt.Volume("data", size="1Gi"),)), TOKEN)
    message = str(err.value)
    assert "Unschedulable" in message and "removed what this deploy had created" in message, message
    assert "StatefulSet job" in message and "PersistentVolumeClaim data" in message, message
    for kind in ("statefulsets", "services", "secrets", "persistentvolumeclaims", "pods"):
        assert c.names(kind) == [], kind


def test_a_failed_first_deploy_is_kept_when_asked(make_cluster, monkeypatch) -> None:
    monkeypatch.setenv("KTLITE_KEEP_FAILED", "true")
    c = make_cluster(only(1, kf.unschedulable()))
    with pytest.raises(DeployError) as err:
        c.backend.apply(spec(), TOKEN)
    assert "kept (keep_failed=true)" in str(err.value) and "ktlite teardown job" in str(err.value)
    assert c.names("statefulsets") == [NAME] and f"{NAME}-0" in c.names("pods")


def test_a_failed_redeploy_keeps_the_deployment_and_says_how_to_remove_it(make_cluster) -> None:
    c = make_cluster(
        lambda pod: (
            kf.unschedulable()
            if pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "64"
            else kf.ready()
        )
    )
    c.backend.apply(spec(cpus=1), TOKEN)
    with pytest.raises(DeployError) as err:
        c.backend.apply(spec(cpus=64), TOKEN)
    message = str(err.value)
    assert "are still there" in message and "ktlite teardown job -n default" in message, message
    assert c.names("statefulsets") == [NAME] and c.names("secrets")


# ---- pods of different sizes: one StatefulSet per run of one size ---------------------------------


def uneven(num_proc: list[int], gpus: int = 1, name: str = NAME) -> DeploymentSpec:
    return DeploymentSpec(
        name,
        kt.Compute(backend="kubernetes", gpus=gpus, launch_timeout=60)
        .distribute("pytorch", num_proc=num_proc)
        .pod_spec(),
    )


def _pod_gpus(pod: dict[str, Any]) -> str:
    return str(pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])


def test_uneven_gpu_pods_are_one_deployment_over_several_statefulsets(cluster: Cluster) -> None:
    applied = cluster.backend.apply(uneven([4, 8, 8, 2]), TOKEN)

    assert cluster.names("statefulsets") == [NAME, f"{NAME}-s1", f"{NAME}-s3"]
    assert cluster.names("services") == [NAME] and cluster.names("secrets") == [f"{NAME}-token"]
    pods = cluster.pods()
    assert sorted(pods) == [f"{NAME}-0", f"{NAME}-s1-1", f"{NAME}-s1-2", f"{NAME}-s3-3"]
    assert {
        n: (p["metadata"]["labels"]["apps.kubernetes.io/pod-index"], _pod_gpus(p))
        for n, p in pods.items()
    } == {
        f"{NAME}-0": ("0", "4"),
        f"{NAME}-s1-1": ("1", "8"),
        f"{NAME}-s1-2": ("2", "8"),
        f"{NAME}-s3-3": ("3", "2"),
    }
    assert [(ep.ordinal, ep.name) for ep in applied.endpoints] == [
        (0, f"{NAME}-0"),
        (1, f"{NAME}-s1-1"),
        (2, f"{NAME}-s1-2"),
        (3, f"{NAME}-s3-3"),
    ]
    assert applied.restarted == [0, 1, 2, 3]

    looked_up = cluster.backend.lookup(NAME)
    assert looked_up is not None and looked_up.token == TOKEN
    assert [ep.name for ep in looked_up.endpoints] == [ep.name for ep in applied.endpoints]
    assert [(r["name"], r["pods"], r["ready"]) for r in cluster.backend.list()] == [(NAME, 4, 4)]

    seen = len(cluster.fake.requests)
    again = cluster.new_backend().apply(uneven([4, 8, 8, 2]), TOKEN)
    assert again.restarted == [] and cluster.writes(seen) == []  # the same shape touches nothing


def test_a_new_shape_replaces_only_the_sets_that_changed(cluster: Cluster) -> None:
    cluster.backend.apply(uneven([2, 4, 4]), TOKEN)
    before = cluster.uids()
    grown = cluster.backend.apply(uneven([2, 4, 4, 4]), TOKEN)  # a pod more of the last size
    assert grown.restarted == [3]
    assert cluster.names("statefulsets") == [NAME, f"{NAME}-s1"]
    assert {n: cluster.uids()[n] for n in before} == before

    # even pods of 4 GPUs: one plain StatefulSet again; the old sets' pods are gone
    even = cluster.backend.apply(uneven([4, 4, 4, 4], gpus=4), TOKEN)
    assert cluster.names("statefulsets") == [NAME]
    assert sorted(cluster.pods()) == [f"{NAME}-{i}" for i in range(4)]
    assert even.restarted == [0, 1, 2, 3]
    sts = cluster.fake.get("statefulsets", "default", NAME)
    assert sts["spec"]["selector"]["matchLabels"] == {km.NAME_LABEL: NAME}
    assert all(_pod_gpus(p) == "4" for p in cluster.pods().values())

    back = cluster.backend.apply(uneven([4, 2]), TOKEN)
    assert cluster.names("statefulsets") == [NAME, f"{NAME}-s1"]
    assert [ep.name for ep in back.endpoints] == [f"{NAME}-0", f"{NAME}-s1-1"]
    assert sorted(cluster.pods()) == [f"{NAME}-0", f"{NAME}-s1-1"]


def test_teardown_removes_every_statefulset_of_the_deployment(make_cluster) -> None:
    c = make_cluster(pod_termination_seconds=2)
    c.backend.apply(uneven([1, 2, 1]), TOKEN)
    c.backend.apply(uneven([1, 1], name="other"), TOKEN)  # another deployment stays
    assert c.names("statefulsets") == [NAME, f"{NAME}-s1", f"{NAME}-s2", "other"]
    assert c.backend.teardown(NAME) is True
    assert c.names("statefulsets") == ["other"]
    assert sorted(c.pods()) == ["other-0", "other-1"]
    assert c.backend.lookup(NAME) is None
    assert [r["name"] for r in c.backend.list()] == ["other"]


# ---- every deployment's NetworkPolicy ------------------------------------------------------------


def monarch_spec(name: str = NAME) -> DeploymentSpec:
    return DeploymentSpec(
        name,
        kt.Compute(backend="kubernetes", launch_timeout=60)
        .distribute("monarch", workers=2, num_proc=2)
        .pod_spec(),
    )


@pytest.mark.parametrize("make", [spec, monarch_spec], ids=["pytorch", "monarch"])
def test_a_deployment_limits_its_ports_before_its_pods_exist(
    cluster: Cluster, make: Callable[[], DeploymentSpec]
) -> None:
    cluster.backend.apply(make(), TOKEN)
    assert cluster.names("networkpolicies") == [NAME]
    policy = cluster.fake.get("networkpolicies", "default", NAME)
    assert policy["metadata"]["labels"][km.NAME_LABEL] == NAME
    assert policy["spec"]["podSelector"] == {"matchLabels": {km.NAME_LABEL: NAME}}
    order = [path for method, path in cluster.writes() if method == "POST"]
    assert order.index(
        "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies"
    ) < order.index("/apis/apps/v1/namespaces/default/statefulsets")
    assert cluster.backend.teardown(NAME) is True
    assert cluster.names("networkpolicies") == []


def test_a_redeploy_keeps_the_policy_and_writes_it_only_when_it_differs(cluster: Cluster) -> None:
    cluster.backend.apply(monarch_spec(), TOKEN)
    cluster.backend.apply(spec(), TOKEN)  # another kind of deployment: the same policy
    assert cluster.names("networkpolicies") == [NAME]
    writes = [w for w in cluster.writes() if "networkpolicies" in w[1]]
    assert [method for method, _ in writes] == ["POST"], writes
    # one an older ktlite made (or edited by hand) is put back as ktlite's
    current = cluster.fake.get("networkpolicies", "default", NAME)
    current["spec"]["ingress"] = [{}]  # admits everyone
    cluster.http.put(
        f"/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/{NAME}", json=current
    ).raise_for_status()
    cluster.backend.apply(spec(), TOKEN)
    again = cluster.fake.get("networkpolicies", "default", NAME)
    assert again["spec"]["ingress"][1] == {
        "from": [{"podSelector": {"matchLabels": {km.NAME_LABEL: NAME}}}]
    }


def test_a_deploy_without_rights_on_policies_fails_saying_what_to_grant(cluster: Cluster) -> None:
    cluster.fake.fail_next(
        "POST",
        "networkpolicies",
        403,
        "Forbidden",
        'networkpolicies.networking.k8s.io is forbidden: User "dev" cannot create resource '
        '"networkpolicies"',
    )
    with pytest.raises(DeployError) as e:
        cluster.backend.apply(spec(), TOKEN)
    text = str(e.value)
    assert "NetworkPolicy 'job'" in text and "networkpolicies.networking.k8s.io" in text, text
    assert "docs/kubernetes.md" in text and TOKEN not in text
    assert cluster.names("statefulsets") == []  # no pod ever ran with its ports open


def test_teardown_without_rights_on_policies_still_removes_the_rest(cluster: Cluster) -> None:
    cluster.backend.apply(spec(), TOKEN)
    cluster.fake.fail_next(
        "DELETE",
        "networkpolicies",
        403,
        "Forbidden",
        'networkpolicies.networking.k8s.io "job" is forbidden: User "dev" cannot '
        'delete resource "networkpolicies"',
    )
    assert cluster.backend.teardown(NAME) is True
    assert cluster.names("statefulsets") == [] and cluster.names("secrets") == []
