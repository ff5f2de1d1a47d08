"""Autoscaled deployments (``Compute.autoscale``) on the Kubernetes backend.

Three layers: the manifests of both forms (the HPA form: Deployment + ClusterIP Service +
autoscaling/v2 HorizontalPodAutoscaler; the Knative form: a serving.knative.dev/v1 Service),
checked against the official schemas (the Knative Service's pod spec as a core/v1 Pod, its
Knative fields structurally); the backend against the fake API server (``kube_fake.py``, fake
clock) for what it creates, updates, reports and removes; and the stand-in cluster
(``kube_harness.py``, one shared per module: real ktlite servers behind the pods) for replicas
that boot from the launch Secret.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import io
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import kube_fake as kf
import kubernetes_validate
import pytest
import server_procs
from kube_cluster import Cluster as StandIn

import ktlite
import ktlite as kt
from ktlite import config
from ktlite.backends import kube_launch
from ktlite.backends import kube_manifests as km
from ktlite.backends import kube_serving as kss
from ktlite.backends.kube_api import KubeApi
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.commands import cli
from ktlite.errors import ConfigError, ImagePullError, LaunchTimeout
from ktlite.modes import status
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.spec import DistributedConfig
from ktlite_wire.launch import Launch, decode_deploy

HERE = Path(__file__).parent
HOST = "https://fake-apiserver"
API_TOKEN = "api-bearer-serving"
TOKEN = "tok-Serv1ng-S3cret-4e5f6a"
NAME = "svc"
IMAGE = f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
HPA_FORM = kss.Capabilities()
KNATIVE = kss.Capabilities(knative=True)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(KubernetesBackend, "_announced", set())
    monkeypatch.setattr(KubernetesBackend, "_noted", set())
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path / "ktlite-home"))
    for env, _, _ in config.KEYS.values():
        monkeypatch.delenv(env, raising=False)


def served(name: str = NAME, kind: str = "cls", **autoscale: Any) -> Callable[..., DeploymentSpec]:
    def make(**compute: Any) -> DeploymentSpec:
        compute.setdefault("launch_timeout", 60)
        return DeploymentSpec(
            name,
            kt.Compute(backend="kubernetes", **compute).autoscale(**autoscale).pod_spec(),
            kind=kind,
        )

    return make


def render(
    spec: DeploymentSpec, caps: kss.Capabilities, token: str | None = TOKEN
) -> list[dict[str, Any]]:
    return kss.render(
        spec,
        "default",
        image=IMAGE,
        install=f"ktlite=={ktlite.__version__}",
        caps=caps,
        token=token,
    )


def one(objs: list[dict[str, Any]], kind: str, api: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (api is None or o["apiVersion"] == api)]
    assert len(found) == 1, [(o["apiVersion"], o["kind"]) for o in objs]
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = workload["spec"]["template"]["spec"]["containers"][0]
    return c


def env(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    entries = container(workload)["env"]
    assert len({e["name"] for e in entries}) == len(entries), "duplicate env names"
    return {e["name"]: e for e in entries}


def validate(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(map(str, e.absolute_path)) or "(top)"
        pytest.fail(
            f"{obj['kind']} {obj['metadata']['name']} is not valid Kubernetes {version} (strict): "
            f"{e.message} at {where}",
            pytrace=False,
        )


def as_pod(ksvc: dict[str, Any]) -> dict[str, Any]:
    """A Knative Service's revision template as the core/v1 Pod its replicas are."""
    template = ksvc["spec"]["template"]
    spec = {
        k: v
        for k, v in template["spec"].items()
        if k not in ("containerConcurrency", "timeoutSeconds")
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "replica", **template["metadata"]},
        "spec": spec,
    }


# ---- manifests: both forms, strictly valid -------------------------------------------------------

CASES: dict[str, Callable[[], DeploymentSpec]] = {
    "defaults": lambda: served()(),
    "cpu-memory": lambda: served(min_scale=1, max_scale=8, concurrency=4)(cpus=2, memory="4Gi"),
    "gpu": lambda: served(min_scale=0, max_scale=2, concurrency=1)(gpus=1, gpu_type="NVIDIA-L4"),
    "metric-cpu": lambda: served(
        metric="cpu", target=60, autoscaler_class="hpa.autoscaling.knative.dev"
    )(cpus=1),
    "metric-memory": lambda: served(
        metric="memory", target_utilization=75, autoscaler_class="hpa.autoscaling.knative.dev"
    )(memory="1Gi"),
    "metric-rps": lambda: served(metric="rps", target=50, window="30s", scale_down_delay="2m")(),
    "everything": lambda: served(
        min_scale=2,
        max_scale=6,
        initial_scale=3,
        concurrency=8,
        target=5,
        target_utilization=60,
        window="20s",
        scale_down_delay="90s",
        scale_to_zero_pod_retention_period="5m",
        progress_deadline="10m",
        panic_window_percentage="20",
    )(
        cpus="500m",
        memory="2Gi",
        env={"MODEL": "tiny"},
        labels={"team": "ml"},
        annotations={"owner": "ml@example.com"},
        node_selector={"pool": "serve"},
        tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        volumes=[kt.Volume("weights", size="1Gi", mount_path="/weights")],
        image=kt.Image("ghcr.io/acme/serve:1").pip_install("numpy").set_env_vars({"A": "1"}),
        service_account="server",
        image_pull_policy="IfNotPresent",
    ),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_hpa_form_objects_are_strictly_valid(case: str, version: str) -> None:
    for caps in (HPA_FORM, kss.Capabilities(custom_metrics=True)):
        objs = render(CASES[case](), caps)
        kinds = [o["kind"] for o in objs]
        assert kinds[:2] == ["Secret", "Secret"] and kinds[-3:] == [
            "Service",
            "Deployment",
            "HorizontalPodAutoscaler",
        ]
        for obj in objs:
            validate(obj, version)
        env(one(objs, "Deployment"))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_knative_form_is_valid_where_kubernetes_defines_it(case: str, version: str) -> None:
    spec = CASES[case]()
    objs = render(spec, KNATIVE)
    ksvc = one(objs, "Service", "serving.knative.dev/v1")
    assert [o["kind"] for o in objs if o is not ksvc] == [
        "Secret",
        "Secret",
        *["PersistentVolumeClaim"] * len(spec.pod.volumes),
        "NetworkPolicy",
    ]
    for obj in objs:
        validate(as_pod(obj) if obj is ksvc else obj, version)
    # Knative's own fields, structurally (no official schema ships for them)
    assert set(ksvc) == {"apiVersion", "kind", "metadata", "spec"} and set(ksvc["spec"]) == {
        "template"
    }
    template = ksvc["spec"]["template"]
    assert set(template) == {"metadata", "spec"}
    assert template["spec"]["containerConcurrency"] == spec.concurrency
    notes = template["metadata"]["annotations"]
    for key, value in spec.autoscale.annotations().items():
        assert notes[key] == value and isinstance(value, str)
    if spec.autoscale.progress_deadline is not None:
        assert notes["serving.knative.dev/progress-deadline"] == spec.autoscale.progress_deadline
    c = container(ksvc)
    assert c["ports"] == [{"name": "http1", "containerPort": km.SERVER_PORT}]  # Knative takes one
    assert "terminationGracePeriodSeconds" not in template["spec"]
    assert len(ksvc["metadata"]["name"]) <= 63


def test_replicas_are_rank_0_boot_from_the_launch_secret_and_are_ready_only_with_code() -> None:
    spec = served(min_scale=1, max_scale=3)(cpus=1)
    for caps in (HPA_FORM, KNATIVE):
        objs = render(spec, caps)
        workload = objs[-1] if caps.knative else one(objs, "Deployment")
        e = env(workload)
        assert e["KTLITE_POD_ORDINAL"] == {"name": "KTLITE_POD_ORDINAL", "value": "0"}
        assert e["KTLITE_LAUNCH_FILE"]["value"] == "/var/run/ktlite/launch/launch.pkl"
        assert e["KTLITE_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "KTLITE_TOKEN" not in e
        assert e["KTLITE_TOKEN_FILE"]["value"] == "/var/run/ktlite/token/token"
        c = container(workload)
        assert c["readinessProbe"]["httpGet"] == {"path": "/health?ready=1", "port": km.SERVER_PORT}
        assert {"name": "ktlite-launch", "mountPath": kss.LAUNCH_DIR, "readOnly": True} in c[
            "volumeMounts"
        ]
        volume = next(
            v
            for v in workload["spec"]["template"]["spec"]["volumes"]
            if v["name"] == "ktlite-launch"
        )
        assert (
            volume["secret"]["secretName"] == f"{NAME}-launch"
            and volume["secret"]["optional"] is True
        )
        launch = objs[1]
        assert (
            launch["metadata"]["name"] == f"{NAME}-launch"
            and launch["type"] == "Opaque"
            and "data" not in launch
        )
    # the same container as a distributed deployment's pods: one bootstrap, the same resources
    sts_container = km.render(
        DeploymentSpec(NAME, kt.Compute(backend="kubernetes", cpus=1).pod_spec()),
        "default",
        image=IMAGE,
        install=f"ktlite=={ktlite.__version__}",
        token=TOKEN,
    )[-1]["spec"]["template"]["spec"]
    deployment = one(render(spec, HPA_FORM), "Deployment")
    assert container(deployment)["command"] == sts_container["containers"][0]["command"]
    assert container(deployment)["resources"] == {"requests": {"cpu": "1"}}


def test_every_object_is_labelled_and_the_service_selects_the_current_template() -> None:
    objs = render(served(min_scale=1)(cpus=1, volumes=[kt.Volume("w", size="1Gi")]), HPA_FORM)
    for obj in objs:
        assert obj["metadata"]["labels"][km.NAME_LABEL] == NAME
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "ktlite"
    deployment, svc = one(objs, "Deployment"), one(objs, "Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    digest = deployment["spec"]["template"]["metadata"]["annotations"][km.HASH_ANNOTATION]
    assert labels[kss.HASH_LABEL] == digest and labels[kss.MODE_LABEL] == "serve"
    assert svc["spec"]["selector"] == {km.NAME_LABEL: NAME, kss.HASH_LABEL: digest}
    assert svc["spec"]["type"] == "ClusterIP" and "clusterIP" not in svc["spec"]
    # a pod-shaping change makes another template (and Service selector); autoscale bounds do not
    other = one(render(served(min_scale=1)(cpus=2), HPA_FORM), "Deployment")
    assert other["spec"]["template"]["metadata"]["annotations"][km.HASH_ANNOTATION] != digest
    bounds = one(
        render(
            served(min_scale=2, max_scale=9)(cpus=1, volumes=[kt.Volume("w", size="1Gi")]), HPA_FORM
        ),
        "Deployment",
    )
    assert bounds["spec"]["template"] == deployment["spec"]["template"]


def test_the_token_is_only_in_its_secret_and_never_in_a_plan() -> None:
    spec = served(min_scale=1)(cpus=1)
    for caps in (HPA_FORM, KNATIVE):
        objs = render(spec, caps)
        holders = [o["metadata"]["name"] for o in objs if TOKEN in repr(o)]
        assert holders == [f"{NAME}-token"]
        assert TOKEN not in repr(render(spec, caps, token=None))
    plan = kt.cls(Model).to(
        kt.Compute(backend="kubernetes", cpus=1).autoscale(min_scale=1), name=NAME, dryrun=True
    )
    assert TOKEN not in str(plan) and km.TOKEN_PLACEHOLDER in str(plan)
    assert [o["kind"] for o in plan.manifests][-3:] == [
        "Service",
        "Deployment",
        "HorizontalPodAutoscaler",
    ]


class Model:
    def __init__(self) -> None:
        self.calls = 0

    def predict(self, x: int) -> int:
        self.calls += 1
        return x * 2


# ---- the HPA: bounds, metric, and the fallbacks said in words ----------------------------------------


def hpa_of(spec: DeploymentSpec, caps: kss.Capabilities = HPA_FORM) -> dict[str, Any]:
    return one(render(spec, caps), "HorizontalPodAutoscaler")["spec"]


def test_hpa_bounds_and_scale_down_delay() -> None:
    h = hpa_of(served(min_scale=2, max_scale=7, scale_down_delay="90s")(cpus=1))
    assert (h["minReplicas"], h["maxReplicas"]) == (2, 7)
    assert h["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 90}}
    assert h["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME}
    h = hpa_of(served()(cpus=1))  # min 0 (Kubetorch's default) and no max
    assert (h["minReplicas"], h["maxReplicas"]) == (1, kss.DEFAULT_MAX_REPLICAS)
    assert h["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 60
    deployment = one(render(served(min_scale=0, initial_scale=0)(cpus=1), HPA_FORM), "Deployment")
    assert deployment["spec"]["replicas"] == 1  # an HPA leaves a Deployment at zero alone
    assert (
        one(render(served(min_scale=1, initial_scale=3)(cpus=1), HPA_FORM), "Deployment")["spec"][
            "replicas"
        ]
        == 3
    )


def test_hpa_metric_follows_the_metric_and_the_adapter() -> None:
    adapter = kss.Capabilities(custom_metrics=True)
    concurrency = served(concurrency=4, max_scale=3)(cpus=1)
    assert hpa_of(concurrency, adapter)["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "ktlite_inflight_calls"},
                "target": {"type": "AverageValue", "averageValue": "2800m"},
            },
        }
    ]
    assert hpa_of(served(metric="rps", target=10, max_scale=3)(cpus=1), adapter)["metrics"][0][
        "pods"
    ] == {
        "metric": {"name": "ktlite_calls_per_second"},
        "target": {"type": "AverageValue", "averageValue": "7"},
    }
    cpu_fallback = {
        "type": "Resource",
        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}},
    }
    assert hpa_of(concurrency)["metrics"] == [cpu_fallback]
    assert hpa_of(served(metric="rps")(cpus=1))["metrics"] == [cpu_fallback]
    assert (
        hpa_of(
            served(metric="cpu", target=55, autoscaler_class="hpa.autoscaling.knative.dev")(cpus=1),
            adapter,
        )["metrics"][0]["resource"]["target"]["averageUtilization"]
        == 55
    )
    memory = hpa_of(
        served(
            metric="memory", target_utilization=65, autoscaler_class="hpa.autoscaling.knative.dev"
        )(memory="1Gi")
    )
    assert memory["metrics"][0]["resource"] == {
        "name": "memory",
        "target": {"type": "Utilization", "averageUtilization": 65},
    }


def test_notes_say_what_the_cluster_cannot_do() -> None:
    spec = served(min_scale=0, concurrency=2)()
    text = "\n".join(kss.notes(spec, HPA_FORM))
    assert (
        "min_scale=0: this cluster has no Knative Serving, so the HorizontalPodAutoscaler keeps at least 1 "
        "replica; install Knative Serving for scale to zero" in text
    )
    assert (
        "metric='concurrency' needs a custom-metrics adapter" in text
        and "scales on CPU instead" in text
    )
    assert f"using {kss.DEFAULT_MAX_REPLICAS} replicas" in text
    assert "needs a CPU request: set Compute(cpus=...)" in text
    assert kss.notes(spec, KNATIVE) == []  # Knative does all of it
    fixed = DeploymentSpec(
        NAME, kt.Compute(backend="kubernetes", replicas=3).served().pod_spec()
    )  # Kubetorch's replicas=N
    assert kss.notes(fixed, HPA_FORM) == []
    h = hpa_of(fixed)
    assert (h["minReplicas"], h["maxReplicas"]) == (3, 3)
    assert one(render(fixed, HPA_FORM), "Deployment")["spec"]["replicas"] == 3
    assert (
        kss.notes(
            served(min_scale=1, max_scale=4, concurrency=2)(cpus=1),
            kss.Capabilities(custom_metrics=True),
        )
        == []
    )


# ---- the backend against the fake API server ---------------------------------------------------------


class Answers(dict):  # type: ignore[type-arg]
    """The fake's proxy table: every pod's server answers GET /health (code or not)."""

    def get(self, key: Any, default: Any = None) -> Any:
        return lambda request: httpx.Response(200, json={"status": "ok"})


class Cluster(StandIn):
    """The stand-in cluster (``kube_cluster``), its pods answering as replicas (``Answers``)."""

    api_token = API_TOKEN

    def __init__(self, behavior: kf.PodBehavior | None = None, **options: Any) -> None:
        super().__init__(behavior, **options)
        self.fake.proxy_handlers = Answers()

    def labelled(self) -> list[tuple[str, str]]:
        return [
            (o["kind"], o["metadata"]["name"])
            for kind in (
                "secrets",
                "services",
                "deployments",
                "horizontalpodautoscalers",
                "pods",
                "ksvc",
                "persistentvolumeclaims",
                "statefulsets",
            )
            for o in (self.fake.objects(kind) if kind != "ksvc" or self.fake.knative else [])
            if (o["metadata"].get("labels") or {}).get(km.NAME_LABEL) == NAME
        ]

    def pods(self) -> list[dict[str, Any]]:
        return [p for p in self.fake.objects("pods") if not p["metadata"].get("deletionTimestamp")]

    def scale(self, replicas: int) -> None:
        """Play the HPA: set the Deployment's replicas."""
        resp = self.http.patch(
            f"/apis/apps/v1/namespaces/default/deployments/{NAME}",
            json={"spec": {"replicas": replicas}},
            headers={"content-type": "application/merge-patch+json"},
        )
        assert resp.status_code == 200, resp.text


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster(lambda pod: kf.running_not_ready())  # servers answer /health, none has code yet
    yield c
    c.http.close()


def test_autoscaler_follows_the_knative_crd(cluster: Cluster) -> None:
    spec = served(min_scale=1)(cpus=1)
    assert cluster.backend.autoscaler(spec) == "hpa"
    knative = Cluster(knative=True)
    assert knative.backend.autoscaler(spec) == "knative"
    asked = len(knative.fake.find_requests("GET", "customresourcedefinitions"))
    knative.backend.autoscaler(spec)
    assert len(knative.fake.find_requests("GET", "customresourcedefinitions")) == asked  # cached


def test_apply_makes_the_hpa_form_and_returns_replicas_without_waiting_for_code(
    cluster: Cluster,
) -> None:
    spec = served(min_scale=0, max_scale=4, initial_scale=2, concurrency=4)(cpus=1)
    applied = cluster.backend.apply(spec, TOKEN)
    assert sorted(cluster.labelled()) == sorted(
        [
            ("Secret", f"{NAME}-token"),
            ("Secret", f"{NAME}-launch"),
            ("Service", NAME),
            ("Deployment", NAME),
            ("HorizontalPodAutoscaler", NAME),
            *[("Pod", p["metadata"]["name"]) for p in cluster.pods()],
        ]
    )
    pods = sorted(cluster.pods(), key=lambda p: p["metadata"]["name"])
    assert len(pods) == 2 and all(p["status"]["conditions"][2]["status"] != "True" for p in pods)
    assert [(e.ordinal, e.name, e.ip, e.incarnation.split("/")[0]) for e in applied.endpoints] == [
        (i, p["metadata"]["name"], p["status"]["podIP"], p["metadata"]["uid"])
        for i, p in enumerate(pods)
    ]
    assert (
        applied.endpoints[0].url
        == f"{HOST}/api/v1/namespaces/default/pods/{pods[0]['metadata']['name']}:32300/proxy"
    )
    assert applied.restarted == [0, 1] and applied.token == TOKEN and TOKEN not in repr(applied)
    said = cluster.out.getvalue()
    assert "install Knative Serving for scale to zero" in said and "scales on CPU instead" in said
    # said once per deployment, not at every deploy
    cluster.backend.apply(spec, TOKEN)
    assert cluster.out.getvalue().count("install Knative Serving") == 1


def test_redeploy_of_code_only_writes_nothing_and_a_new_shape_rolls_the_replicas(
    cluster: Cluster,
) -> None:
    spec = served(min_scale=1, max_scale=4)(cpus=1)
    first = cluster.backend.apply(spec, TOKEN)
    cluster.scale(3)  # the HPA scaled it
    seen = len(cluster.fake.requests)
    again = cluster.backend.apply(spec, TOKEN)
    assert cluster.writes(seen) == []
    assert (
        len(again.endpoints) == 3 and again.restarted == [] and again.spec_hash == first.spec_hash
    )
    bigger = cluster.backend.apply(served(min_scale=1, max_scale=5)(cpus=2), TOKEN)
    deployment = cluster.fake.get("deployments", "default", NAME)
    assert deployment is not None and deployment["spec"]["replicas"] == 3  # the HPA's count is kept
    assert (
        deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
        == "2"
    )
    hpa = cluster.fake.get("hpa", "default", NAME)
    assert hpa is not None and hpa["spec"]["maxReplicas"] == 5
    assert bigger.spec_hash != first.spec_hash and bigger.endpoints
    assert {e.name for e in bigger.endpoints}.isdisjoint({e.name for e in first.endpoints})
    svc = cluster.fake.get("services", "default", NAME)
    assert svc is not None and svc["spec"]["selector"][kss.HASH_LABEL] == bigger.spec_hash
    # the config is kept on the Deployment: another process serves it the same way
    found = cluster.backend.lookup(NAME)
    assert found is not None and found.autoscale == asdict(
        served(min_scale=1, max_scale=5)(cpus=2).autoscale
    )
    seen = len(cluster.fake.requests)
    cluster.backend.apply(
        served(min_scale=2, max_scale=5)(cpus=2), TOKEN
    )  # new bounds only: no pod restarts
    assert [m for m, _ in cluster.writes(seen)] == [
        "PATCH",
        "PUT",
    ]  # the Deployment's annotation, the HPA
    assert cluster.backend.lookup(NAME).autoscale["min_scale"] == 2  # type: ignore[union-attr]


def test_a_new_token_restarts_the_replicas(cluster: Cluster) -> None:
    spec = served(min_scale=1)(cpus=1)
    first = cluster.backend.apply(spec, TOKEN)
    second = cluster.backend.apply(spec, "another-token")
    assert {e.incarnation for e in first.endpoints}.isdisjoint(
        {e.incarnation for e in second.endpoints}
    )


def test_lookup_reports_the_replicas_that_run_now(cluster: Cluster) -> None:
    spec = served(min_scale=1, max_scale=4)(cpus=1)
    cluster.backend.apply(spec, TOKEN)
    cluster.scale(3)
    found = cluster.backend.lookup(NAME)
    assert found is not None and len(found.endpoints) == 3 and found.token == TOKEN
    assert [e.ordinal for e in found.endpoints] == [0, 1, 2]
    assert [e.name for e in found.endpoints] == sorted(e.name for e in found.endpoints)
    gone = found.endpoints[1]
    assert cluster.http.delete(f"/api/v1/namespaces/default/pods/{gone.name}").status_code == 200
    after = cluster.backend.lookup(NAME)
    assert (
        after is not None
        and len(after.endpoints) == 3
        and gone.name not in {e.name for e in after.endpoints}
    )
    assert gone.incarnation not in {e.incarnation for e in after.endpoints}
    cluster.scale(1)  # scale down: the newest go
    assert len(cluster.backend.lookup(NAME).endpoints) == 1  # type: ignore[union-attr]
    assert cluster.backend.lookup("nothing-here") is None


def _kept_launch(cluster: Cluster) -> tuple[Launch, str]:
    """The launch the launch Secret holds, and the generation its annotation says."""
    secret = cluster.fake.get("secrets", "default", f"{NAME}-launch")
    assert secret is not None
    kept = decode_deploy(gzip.decompress(base64.b64decode(secret["data"]["launch.pkl"])))
    assert isinstance(kept, Launch)
    return kept, secret["metadata"]["annotations"][kube_launch.GENERATION_ANNOTATION]


def test_write_launch_fills_the_secret_with_the_next_generation_and_refuses_what_a_secret_cannot_hold(
    cluster: Cluster,
) -> None:
    cluster.backend.apply(served(min_scale=1)(cpus=1), TOKEN)
    assert cluster.backend.write_launch(NAME, launch_message("launch-1")).generation == 1
    assert cluster.backend.write_launch(NAME, launch_message("launch-2")).generation == 2
    kept, annotated = _kept_launch(cluster)
    assert (kept.launch_id, kept.generation, annotated) == ("launch-2", 2, "2")
    # it is kept gzipped (local modules travel as source text): 1.1 MB of text fits
    text = launch_message("text", code=b"def f(): return 1\n" * 60_000)
    assert cluster.backend.write_launch(NAME, text).generation == 3
    with pytest.raises(
        ConfigError, match=r"pickles to 1\.10 MB \(1\.10 MB compressed\).*bake big dependencies"
    ):
        cluster.backend.write_launch(NAME, launch_message("big", code=os.urandom(1_100_000)))
    # a refused launch takes no generation
    assert cluster.backend.write_launch(NAME, launch_message("launch-2")).generation == 4
    # a redeploy neither empties it nor starts the generations again
    cluster.backend.apply(served(min_scale=1)(cpus=1), TOKEN)
    kept, annotated = _kept_launch(cluster)
    assert (kept.launch_id, kept.generation, annotated) == ("launch-2", 4, "4")
    assert cluster.backend.write_launch(NAME, launch_message("launch-3")).generation == 5


class _Racing:
    """The cluster's API, where another .to() writes its launch just before our first write."""

    def __init__(self, api: KubeApi) -> None:
        self.api, self.rival = api, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def patch(self, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        if self.rival is None:
            self.rival = kube_launch.write(self.api, NAME, launch_message("rival"))
        return self.api.patch(kind, name, patch)


def test_two_writers_of_the_launch_secret_at_once_get_two_generations(cluster: Cluster) -> None:
    cluster.backend.apply(served(min_scale=1)(cpus=1), TOKEN)
    racing = _Racing(cluster.backend._api())
    # both read the Secret at generation 0; the rival writes first, ours meets a conflict
    # and is written again as the next generation
    mine = kube_launch.write(racing, NAME, launch_message("mine"))  # type: ignore[arg-type]
    assert racing.rival is not None and racing.rival.generation == 1
    assert mine.generation == 2
    kept, annotated = _kept_launch(cluster)
    assert (kept.launch_id, kept.generation, annotated) == ("mine", 2, "2")


def test_scaling_status_shows_the_hpa_and_its_failed_metric(cluster: Cluster) -> None:
    cluster.backend.apply(served(min_scale=1, max_scale=4, concurrency=2)(cpus=1), TOKEN)
    # the fake's HPA controller is a cluster's without metrics-server: it says it has no metric
    said = cluster.backend.scaling_status(NAME)
    assert said is not None and said["current"] == 1
    assert [(c["type"], c["status"], c["reason"]) for c in said["conditions"]] == [
        ("AbleToScale", "True", "SucceededGetScale"),
        ("ScalingActive", "False", "FailedGetResourceMetric"),
    ]
    cluster.fake.set_status(
        "hpa",
        "default",
        NAME,
        {
            "currentReplicas": 2,
            "desiredReplicas": 3,
            "lastScaleTime": "2026-11-25T18:00:00Z",
            "conditions": [
                {
                    "type": "AbleToScale",
                    "status": "True",
                    "reason": "SucceededGetScale",
                    "message": "the HPA controller was able to get the target's current scale",
                },
                {
                    "type": "ScalingActive",
                    "status": "False",
                    "reason": "FailedGetResourceMetric",
                    "message": "the HPA was unable to compute the replica count: failed to get cpu utilization: "
                    "unable to get metrics for resource cpu: no metrics returned from resource metrics API",
                },
            ],
        },
    )
    status = cluster.backend.scaling_status(NAME)
    assert status is not None
    assert {
        k: status[k] for k in ("autoscaler", "current", "desired", "min", "max", "last_scale_time")
    } == {
        "autoscaler": "hpa",
        "current": 2,
        "desired": 3,
        "min": 1,
        "max": 4,
        "last_scale_time": "2026-11-25T18:00:00Z",
    }
    assert status["conditions"][1]["reason"] == "FailedGetResourceMetric"
    assert "no metrics returned" in status["conditions"][1]["message"]
    assert status["metric"] == {
        "name": "cpu",
        "target": "80%",
        "current": None,
        "instead_of": "concurrency",
    }
    assert cluster.backend.scaling_status("nothing-here") is None


def test_ktlite_status_says_what_the_cluster_scales_on() -> None:
    """Asked for concurrency, a cluster without a custom-metrics adapter scales on CPU (as the
    deploy said): `ktlite status` shows CPU, and the metric asked for as the one it replaces."""
    for adapter, said in (
        (
            False,
            "metric cpu (target 80%, now 12%), instead of concurrency (asked for, "
            "but it needs a custom-metrics adapter, which this cluster lacks)",
        ),
        (True, "metric ktlite_inflight_calls (target 1400m),"),
    ):
        c = Cluster(lambda pod: kf.running_not_ready(), custom_metrics=adapter)
        c.backend.apply(served(min_scale=1, max_scale=4, concurrency=2)(cpus=1), TOKEN)
        if not adapter:
            c.fake.set_status(
                "hpa",
                "default",
                NAME,
                {
                    "currentReplicas": 1,
                    "desiredReplicas": 1,
                    "currentMetrics": [
                        {
                            "type": "Resource",
                            "resource": {"name": "cpu", "current": {"averageUtilization": 12}},
                        }
                    ],
                },
            )
        applied = c.backend.lookup(NAME)  # asked for: the default metric, concurrency
        assert applied is not None and applied.autoscale["metric"] is None
        first = status.serving(
            NAME, applied.autoscale, c.backend.scaling_status(NAME), []
        ).splitlines()[0]
        assert f"{NAME}: autoscaled, 0 replica(s) running (1..4), {said}" in first, first
        assert "metric concurrency" not in first
        c.http.close()
    # ktlite's own autoscaler (local) reports the metric by name: the one asked for
    assert "metric rps," in status.serving(
        NAME, {"metric": "rps", "concurrency": 4}, {"metric": "rps"}, []
    )


def test_teardown_leaves_nothing_labelled_and_list_marks_served_deployments(
    cluster: Cluster,
) -> None:
    cluster.backend.apply(served(min_scale=1)(cpus=1, volumes=[kt.Volume("w", size="1Gi")]), TOKEN)
    other = Cluster()
    other.backend.apply(
        DeploymentSpec(
            "plain",
            kt.Compute(backend="kubernetes", launch_timeout=60).distribute(workers=1).pod_spec(),
        ),
        TOKEN,
    )
    rows = {r["name"]: r for r in cluster.backend.list()}
    assert rows[NAME]["autoscaled"] is True and rows[NAME]["autoscaler"] == "hpa"
    assert [r["autoscaled"] for r in other.backend.list()] == [False]
    assert cluster.backend.teardown(NAME, volumes=True) is True
    assert cluster.labelled() == []
    assert cluster.backend.list() == []
    assert cluster.backend.teardown(NAME) is False


def test_a_served_deployment_replaces_a_distributed_one_of_the_same_name_and_back(
    cluster: Cluster,
) -> None:
    plain = DeploymentSpec(
        NAME, kt.Compute(backend="kubernetes", launch_timeout=60).distribute(workers=2).pod_spec()
    )
    cluster.fake.pod_behavior = lambda pod: kf.ready()
    cluster.backend.apply(plain, TOKEN)
    cluster.fake.pod_behavior = lambda pod: kf.running_not_ready()
    applied = cluster.backend.apply(served(min_scale=1)(cpus=1), TOKEN)
    assert cluster.fake.objects("statefulsets") == []
    svc = cluster.fake.get("services", "default", NAME)
    assert svc is not None and svc["spec"]["clusterIP"] != "None"
    assert len(applied.endpoints) == 1
    cluster.fake.pod_behavior = lambda pod: kf.ready()
    back = cluster.backend.apply(plain, TOKEN)
    assert len(back.endpoints) == 2
    assert cluster.fake.objects("deployments") == [] and cluster.fake.objects("hpa") == []
    assert cluster.fake.get("secrets", "default", f"{NAME}-launch") is None


def test_a_replica_that_cannot_start_fails_the_deploy_with_its_reason(cluster: Cluster) -> None:
    cluster.fake.pod_behavior = lambda pod: [
        (0, kf.pending()),
        (1, kf.err_image_pull()),
        (2, kf.image_pull_backoff()),
    ]
    with pytest.raises(ImagePullError, match="cannot be pulled"):
        cluster.backend.apply(served(min_scale=1)(image="ghcr.io/acme/missing:1"), TOKEN)
    assert cluster.labelled() == []  # a first deploy that failed is removed again


def test_a_replica_that_never_answers_times_out_saying_what_was_awaited(cluster: Cluster) -> None:
    cluster.fake.proxy_handlers = {}  # the servers never answer
    with pytest.raises(LaunchTimeout) as e:
        cluster.backend.apply(served(min_scale=1)(launch_timeout=20), TOKEN)
    text = str(e.value)
    assert "no replica's server answered /health within launch_timeout=20s" in text
    assert "replicas scheduled 1/1, running 1/1, ready 0/1" in text
    assert f"kubectl -n default describe pods -l {km.NAME_LABEL}={NAME}" in text


def test_knative_form_against_a_cluster_with_knative() -> None:
    c = Cluster(lambda pod: kf.running_not_ready(), knative=True)
    spec = served(min_scale=0, max_scale=4, initial_scale=2, concurrency=3)(cpus=1)
    applied = c.backend.apply(spec, TOKEN)
    assert c.out.getvalue().count("Knative") == 0  # nothing to say: Knative does it all
    ksvc = c.fake.get("ksvc", "default", NAME)
    assert ksvc is not None and ksvc["spec"]["template"]["spec"]["containerConcurrency"] == 3
    assert c.fake.objects("deployments") == [] and c.fake.objects("hpa") == []
    assert c.fake.get("services", "default", NAME) is None  # Knative makes its own
    assert len(applied.endpoints) == 2 and all(
        "-00001-deployment-" in e.name for e in applied.endpoints
    )
    assert c.backend.lookup(NAME).autoscale == asdict(spec.autoscale)  # type: ignore[union-attr]
    status = c.backend.scaling_status(NAME)
    assert (
        status is not None
        and status["autoscaler"] == "knative"
        and status["revision"] == f"{NAME}-00001"
    )
    assert (status["min"], status["max"]) == (0, 4)
    rows = c.backend.list()
    assert rows == [
        {
            "name": NAME,
            "backend": "kubernetes",
            "namespace": "default",
            "pods": 2,
            "ready": 0,
            "detached": True,
            "autoscaled": True,
            "autoscaler": "knative",
        }
    ]
    # a new shape is a new revision, with new replicas
    again = c.backend.apply(
        served(min_scale=0, max_scale=4, initial_scale=2, concurrency=3)(cpus=2), TOKEN
    )
    assert all("-00002-deployment-" in e.name for e in again.endpoints)
    c.fake.knative_scale[("default", NAME)] = 3  # Knative's autoscaler wants 3
    assert len(c.backend.lookup(NAME).endpoints) == 3  # type: ignore[union-attr]
    assert c.backend.teardown(NAME) is True
    assert c.labelled() == []


def test_knative_scaled_to_zero_applies_once_the_service_is_ready() -> None:
    c = Cluster(knative=True)
    c.fake.knative_scale[("default", NAME)] = 0
    applied = c.backend.apply(served(min_scale=0, initial_scale=0)(cpus=1), TOKEN)
    assert applied.endpoints == []
    # the first call wakes it through the revision's Service (Knative's activator), with the
    # headers Knative's ingress sets
    assert c.backend.wake(NAME, timeout=5.0) is True
    sent = [
        r for r in c.fake.requests if "/services/" in r.path and r.path.endswith("/proxy/health")
    ][-1]
    assert sent.path == f"/api/v1/namespaces/default/services/{NAME}-00001:http/proxy/health"
    assert sent.headers["knative-serving-revision"] == f"{NAME}-00001"
    assert sent.headers["knative-serving-namespace"] == "default"
    assert len(c.backend.lookup(NAME).endpoints) == 1  # type: ignore[union-attr]


# ---- the stand-in cluster: real servers behind the replicas --------------------------------------


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One stand-in cluster for this module's tests (each uses its own deployment name)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("the stand-in cluster's pods need root and unshare")
    root = tmp_path_factory.mktemp("stand-in")
    with open(root / "harness.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "kube_harness.py"), str(root)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while not (root / "kubeconfig").exists():
            assert proc.poll() is None, (root / "harness.log").read_text()
            assert time.monotonic() < deadline, "the stand-in cluster did not start within 30 s"
            time.sleep(0.05)
        yield root
    finally:
        server_procs.stop_group(proc)


@pytest.fixture
def real(stand_in: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubernetesBackend]:
    from ktlite.backends.kube_api import load

    http, info = load(str(stand_in / "kubeconfig"))
    out = io.StringIO()
    yield KubernetesBackend(http, info, out=out)
    http.close()


def launch_message(launch_id: str, code: bytes | None = None) -> Launch:
    """A deploy message as the client sends it to a replica (a class of the standard library)."""
    from ktlite.net.packaging import bundle

    return Launch(
        launch_id=launch_id,
        bundle=bundle(dict) if code is None else code,
        kind="cls",
        distributed=DistributedConfig(),
        pod_ips=["127.0.0.1"],
        master_port=29500,
        replica=True,
        concurrency=4,
        load_timeout=60.0,
        single=True,
    )


def health(backend: KubernetesBackend, url: str, ready: bool = False) -> httpx.Response:
    http = backend._connect()[0]
    return http.get(
        f"{url}/health" + ("?ready=1" if ready else ""),
        timeout=10,
        headers={"x-ktlite-token": f"Bearer {TOKEN}"},
    )


def wait_for(
    read: Callable[[], Any], done: Callable[[Any], bool], timeout: float, what: str
) -> Any:
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value):
        assert time.monotonic() < deadline, f"waited {timeout:g}s for {what}; last seen: {value!r}"
        time.sleep(0.2)
        value = read()
    return value


@pytest.mark.timeout(180)
def test_a_replica_the_autoscaler_adds_boots_from_the_launch_secret(
    real: KubernetesBackend,
) -> None:
    name = f"boot-{uuid.uuid4().hex[:6]}"
    spec = DeploymentSpec(
        name,
        kt.Compute(backend="kubernetes", cpus=1, launch_timeout=60)
        .autoscale(min_scale=1, max_scale=3)
        .pod_spec(),
        kind="cls",
    )
    try:
        applied = real.apply(spec, TOKEN)
        assert len(applied.endpoints) == 1
        first = applied.endpoints[0]
        answer = health(real, first.url)
        assert answer.status_code == 200 and answer.json()["launch_id"] is None
        not_ready = health(real, first.url, ready=True)
        assert not_ready.status_code == 503 and "no launch" in not_ready.json()["detail"]
        real.write_launch(name, launch_message("launch-one"))
        # the HPA adds a replica: it mounts the launch Secret and is ready with that launch at boot
        api = real._api()
        api.patch("Deployment", name, {"spec": {"replicas": 2}})
        grown = wait_for(
            lambda: real.lookup(name),
            lambda a: a is not None and len(a.endpoints) == 2,
            60,
            "a second replica",
        )
        new = next(e for e in grown.endpoints if e.name != first.name)
        ready = wait_for(
            lambda: health(real, new.url, ready=True),
            lambda r: r.status_code == 200,
            60,
            "the new replica to load the launch and report ready",
        )
        assert ready.json()["launch_id"] == "launch-one" and ready.json()["ordinal"] == 0
        # a redeploy's launch reaches replicas started after it
        real.write_launch(name, launch_message("launch-two"))
        api.patch("Deployment", name, {"spec": {"replicas": 3}})
        grown = wait_for(
            lambda: real.lookup(name),
            lambda a: a is not None and len(a.endpoints) == 3,
            60,
            "a third replica",
        )
        third = next(
            e
            for e in grown.endpoints
            if e.name not in {x.name for x in applied.endpoints} | {new.name}
        )
        ready = wait_for(
            lambda: health(real, third.url, ready=True),
            lambda r: r.status_code == 200,
            60,
            "the third replica to report ready",
        )
        assert ready.json()["launch_id"] == "launch-two"
        # the ClusterIP Service selects the replicas of the current template
        svc = api.get("Service", name)
        assert svc is not None and svc["spec"]["selector"][kss.HASH_LABEL] == applied.spec_hash
    finally:
        real.teardown(name)
    api = real._api()
    left = [
        (kind, o["metadata"]["name"])
        for kind in ("Pod", "Secret", "Service", "Deployment", "HorizontalPodAutoscaler")
        for o in api.list(kind, km.selector(name))
    ]
    assert left == []


# ---- end to end through the public API, on the stand-in cluster ---------------------------------


class Echo:
    def who(self, sleep: float = 0.0) -> tuple[str, str]:
        import os
        import time

        time.sleep(sleep)
        return os.environ["KTLITE_POD_NAME"], "v1"


class EchoV2:
    def who(self, sleep: float = 0.0) -> tuple[str, str]:
        import os
        import time

        time.sleep(sleep)
        return os.environ["KTLITE_POD_NAME"], "v2"


@pytest.mark.timeout(240)
def test_a_served_class_end_to_end_through_the_public_api(
    stand_in: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KTLITE_KUBECONFIG", str(stand_in / "kubeconfig"))
    monkeypatch.setattr(KubernetesBackend, "_clients", {})
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    compute = kt.Compute(backend="kubernetes", cpus=1, launch_timeout=60).autoscale(
        min_scale=1, max_scale=3, concurrency=2
    )
    backend = KubernetesBackend.shared()
    remote = second = None
    try:
        remote = kt.cls(Echo, name=name).to(compute)
        pod, version = remote.who()  # one call, one replica, one value
        assert version == "v1" and pod.startswith(f"{name}-")
        status = remote.status()
        assert [r["name"] for r in status["replicas"]] == [pod]
        assert status["autoscaler"]["autoscaler"] == "hpa"
        # the handle's scaling_status() is the cluster's HPA (the stand-in has no adapter: CPU)
        said = remote.scaling_status()
        assert said["autoscaler"] == "hpa" and (said["min"], said["max"]) == (1, 3)
        assert said["metric"]["name"] == "cpu" and said["metric"]["instead_of"] == "concurrency"
        capsys.readouterr()
        assert cli.main(["status", name, "--backend", "kubernetes"]) == 0
        assert "metric cpu (target 80%), instead of concurrency" in capsys.readouterr().out
        # the cluster's HPA adds a replica (played here): it boots with the current code and takes calls
        backend._api().patch("Deployment", name, {"spec": {"replicas": 2}})
        wait_for(
            lambda: len(remote.status()["replicas"]),
            lambda n: n == 2,
            90,
            "the client to route to 2 replicas",
        )
        futures = [remote.who.submit(sleep=1.0) for _ in range(4)]  # 4 calls, at most 2 per replica
        served_by = {f.result(timeout=60) for f in futures}
        assert {v for _, v in served_by} == {"v1"} and len({p for p, _ in served_by}) == 2
        # new code: every replica runs it once .to() returns, none restarts
        pods = {r["name"] for r in remote.status()["replicas"]}
        second = kt.cls(EchoV2, name=name).to(compute)
        answers = {second.who() for _ in range(6)}
        assert {v for _, v in answers} == {"v2"} and {p for p, _ in answers} <= pods
        assert {r["name"] for r in second.status()["replicas"]} == pods
        # a replica started after the redeploy loads the new code from the launch Secret
        backend._api().patch("Deployment", name, {"spec": {"replicas": 3}})
        wait_for(lambda: len(second.status()["replicas"]), lambda n: n == 3, 90, "a third replica")
        third = ({r["name"] for r in second.status()["replicas"]} - pods).pop()
        futures = [second.who.submit(sleep=1.0) for _ in range(6)]
        results = [f.result(timeout=60) for f in futures]
        assert {v for _, v in results} == {"v2"} and third in {p for p, _ in results}
        assert [r for r in backend.list() if r["name"] == name][0]["autoscaled"] is True
        (second or remote).teardown()
        api = backend._api()
        assert [
            o["metadata"]["name"]
            for kind in ("Pod", "Secret", "Service", "Deployment", "HorizontalPodAutoscaler")
            for o in api.list(kind, km.selector(name))
        ] == []
    finally:
        with contextlib.suppress(Exception):
            backend.teardown(name)  # even when .to() failed half-way
        for client, _ in KubernetesBackend._clients.values():
            client.close()


def test_an_account_without_rights_on_served_kinds_still_runs_distributed_deployments() -> None:
    """The Role of docs/kubernetes.md before serving: no deployments, HPAs or Knative Services."""
    c = Cluster()
    c.fake.fail_next(
        "*",
        r"deployments|horizontalpodautoscalers|serving\.knative\.dev",
        status=403,
        reason="Forbidden",
        message="forbidden: the Role has no such rule",
        times=10_000,
    )
    plain = DeploymentSpec(
        "plain",
        kt.Compute(backend="kubernetes", launch_timeout=60).distribute(workers=1).pod_spec(),
    )
    assert len(c.backend.apply(plain, TOKEN).endpoints) == 1
    assert [r["name"] for r in c.backend.list()] == ["plain"]
    assert c.backend.lookup("missing") is None and c.backend.scaling_status("plain") is None
    assert c.backend.teardown("plain") is True


# ---- the fake's controllers for these kinds --------------------------------------------------------


def _deployment(replicas: int, cpu: str = "1") -> dict[str, Any]:
    labels = {"app": "web"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "python:3.11-slim",
                            "resources": {"requests": {"cpu": cpu}},
                        }
                    ]
                },
            },
        },
    }


def test_fake_deployments_scale_the_newest_away_and_roll_with_no_unavailable_replica() -> None:
    state: dict[str, kf.PodState] = {"next": kf.ready()}
    c = Cluster(lambda pod: state["next"])
    c.fake.create("deployments", "default", _deployment(2))
    first = [p["metadata"]["name"] for p in c.pods()]
    assert len(first) == 2 and all(n.startswith("web-") and len(n.split("-")) == 3 for n in first)
    c.clock.advance(1)
    c.http.patch(
        "/apis/apps/v1/namespaces/default/deployments/web",
        json={"spec": {"replicas": 3}},
        headers={"content-type": "application/merge-patch+json"},
    )
    newest = ({p["metadata"]["name"] for p in c.pods()} - set(first)).pop()
    c.http.patch(
        "/apis/apps/v1/namespaces/default/deployments/web",
        json={"spec": {"replicas": 2}},
        headers={"content-type": "application/merge-patch+json"},
    )
    assert sorted(p["metadata"]["name"] for p in c.pods()) == sorted(first) and newest not in first
    # a new template: the old replicas stay until as many new ones are ready
    state["next"] = kf.running_not_ready()
    c.http.put("/apis/apps/v1/namespaces/default/deployments/web", json=_deployment(2, cpu="2"))
    names = {p["metadata"]["name"] for p in c.pods()}
    assert set(first) <= names and len(names) == 4
    for pod in c.pods():
        if pod["metadata"]["name"] not in first:
            c.fake.set_pod_script(pod["metadata"]["name"], kf.ready())
    assert not {p["metadata"]["name"] for p in c.pods()} & set(first)
    status = c.fake.get("deployments", "default", "web")["status"]  # type: ignore[index]
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
    c.http.delete("/apis/apps/v1/namespaces/default/deployments/web")
    assert c.pods() == []  # its replicas go with it


def test_fake_knative_is_served_only_when_switched_on() -> None:
    c = Cluster()
    path = "/apis/serving.knative.dev/v1/namespaces/default/services"
    assert c.http.get(path).status_code == 404
    assert (
        c.http.get(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/services.serving.knative.dev"
        ).status_code
        == 404
    )
    c.fake.knative = True
    assert c.http.get(path).json()["items"] == []
    two_ports = {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {"name": "k"},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"image": "x", "ports": [{"containerPort": 1}, {"containerPort": 2}]}
                    ]
                }
            }
        },
    }
    refused = c.http.post(path, json=two_ports)
    assert (
        refused.status_code == 422 and "more than one container port" in refused.json()["message"]
    )


def test_calls_to_a_knative_replica_go_through_its_queue_proxy() -> None:
    """Knative's autoscaler counts the calls its queue-proxy sees: a replica Knative made is
    called on the queue-proxy's port, a replica of the HPA form on the server's."""
    from ktlite.backends.kube_served_status import call_port

    plain = {
        "spec": {"containers": [{"name": "server", "ports": [{"containerPort": km.SERVER_PORT}]}]}
    }
    knative = {
        "spec": {
            "containers": [
                plain["spec"]["containers"][0],
                {
                    "name": "queue-proxy",
                    "ports": [
                        {"name": "http-queueadm", "containerPort": 8022},
                        {"name": "queue-port", "containerPort": 8013},
                    ],
                },
            ]
        }
    }
    assert call_port(plain) == km.SERVER_PORT
    assert call_port(knative) == 8013
    knative["spec"]["containers"][1]["ports"] = []
    assert call_port(knative) == 8012
