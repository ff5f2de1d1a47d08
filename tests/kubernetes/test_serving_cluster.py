"""Autoscaled serving on a real cluster (opt-in), the HPA form: a Deployment of replicas, a
ClusterIP Service and an autoscaling/v2 HorizontalPodAutoscaler, as ktlite makes them where
Knative Serving is not installed.

The test plays the HPA's part where it must (a test cluster may have no metrics-server, so its
HPA never scales): it sets the Deployment's replicas, and checks that a replica started that way
boots from the launch Secret, loads the current code and only then reports ready. What the HPA
itself says (its conditions, e.g. FailedGetResourceMetric without metrics-server) must reach
``scaling_status`` as the cluster wrote it.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import NAME_LABEL

import ktlite as kt
from ktlite.backends.registry import get_backend
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.spec import DistributedConfig
from ktlite_wire.headers import TOKEN_HEADER, bearer
from ktlite_wire.launch import Launch

pytestmark = pytest.mark.filterwarnings("ignore:Unverified HTTPS request")


def launch(launch_id: str) -> Launch:
    """A deploy message as the client leaves it for replicas (a class of the standard library)."""
    from ktlite.net.packaging import bundle

    return Launch(
        launch_id=launch_id,
        bundle=bundle(dict),
        kind="cls",
        distributed=DistributedConfig(),
        pod_ips=["127.0.0.1"],
        master_port=29500,
        replica=True,
        concurrency=4,
        load_timeout=120.0,
        single=True,
    )


def wait_for(
    read: Callable[[], Any], done: Callable[[Any], bool], timeout: float, what: str
) -> Any:
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value):
        assert time.monotonic() < deadline, f"waited {timeout:g}s for {what}; last seen: {value!r}"
        time.sleep(1.0)
        value = read()
    return value


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_hpa_form_end_to_end(settings, deployments, make_compute, kube):
    name = deployments.name("serve")
    compute = make_compute(launch_timeout=240).autoscale(min_scale=0, max_scale=3, concurrency=2)
    spec = DeploymentSpec(name, compute.pod_spec(), kind="cls")
    backend = get_backend("kubernetes", namespace=settings.namespace)
    token = secrets.token_urlsafe(16)
    if backend.autoscaler(spec) != "hpa":
        pytest.skip(
            "this cluster has Knative Serving: the HPA form is not what ktlite deploys here"
        )
    http = None
    try:
        applied = backend.apply(spec, token)
        http = applied.http
        assert len(applied.endpoints) == 1
        first = applied.endpoints[0]

        def health(url: str, ready: bool = False) -> Any:
            client = http or __import__("httpx")
            return client.get(
                f"{url}/health" + ("?ready=1" if ready else ""),
                timeout=10,
                headers={TOKEN_HEADER: bearer(token)},
            )

        # running and answering, but not ready: no code yet
        assert health(first.url).status_code == 200
        assert health(first.url, ready=True).status_code == 503
        # the objects, as the cluster holds them
        selector = f"{NAME_LABEL}={name}"
        hpa = kube.autoscaling.read_namespaced_horizontal_pod_autoscaler(name, settings.namespace)
        assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (1, 3)
        assert (
            hpa.spec.scale_target_ref.kind == "Deployment"
            and hpa.spec.scale_target_ref.name == name
        )
        svc = kube.core.read_namespaced_service(name, settings.namespace)
        assert svc.spec.type == "ClusterIP" and svc.spec.cluster_ip not in (None, "None")
        pods = kube.list("pods", selector)
        assert [p.metadata.name for p in pods] == [first.name]
        assert pods[0].spec.containers[0].readiness_probe.http_get.path == "/health?ready=1"

        # the client's first push leaves the launch for replicas started later
        assert backend.write_launch(name, launch("launch-one")).generation == 1
        kube.apps.patch_namespaced_deployment(name, settings.namespace, {"spec": {"replicas": 2}})
        grown = wait_for(
            lambda: backend.lookup(name),
            lambda a: a is not None and len(a.endpoints) == 2,
            240,
            "the second replica to run",
        )
        second = next(e for e in grown.endpoints if e.name != first.name)
        ready = wait_for(
            lambda: health(second.url, ready=True),
            lambda r: r.status_code == 200,
            240,
            "the second replica to load the launch from its Secret and report ready",
        )
        assert ready.json()["launch_id"] == "launch-one"
        # the kubelet's readiness probe agrees
        wait_for(
            lambda: kube.pod(second.name),
            lambda p: any(
                c.type == "Ready" and c.status == "True" for c in p.status.conditions or []
            ),
            60,
            "the kubelet to report the second replica Ready",
        )
        # the first replica never got code (no push in this test): it stays unready
        assert health(first.url, ready=True).status_code == 503

        # what the HPA controller says reaches scaling_status as the cluster wrote it
        raw = wait_for(
            lambda: kube.autoscaling.read_namespaced_horizontal_pod_autoscaler(
                name, settings.namespace
            ),
            lambda h: bool(h.status.conditions),
            90,
            "the HPA controller's first conditions",
        )
        status = backend.scaling_status(name)
        assert (
            status is not None
            and status["autoscaler"] == "hpa"
            and (status["min"], status["max"]) == (1, 3)
        )
        conditions = {c["type"]: c for c in status["conditions"]}
        for c in raw.status.conditions:
            assert (
                conditions[c.type]["reason"] == c.reason
                and conditions[c.type]["status"] == c.status
            )
        active = conditions.get("ScalingActive")
        print(f"\nHPA conditions: {status['conditions']}\nmetric: {status['metric']}")
        assert active is not None and (
            active["status"] == "True" or active["reason"].startswith("FailedGet")
        )
        rows = [r for r in backend.list() if r["name"] == name]
        assert rows and rows[0]["autoscaled"] is True
    finally:
        backend.teardown(name)
    left = kube.wait_gone(f"{NAME_LABEL}={name}", timeout=120)
    assert left == {}


class Echo:
    version = "v1"

    def who(self, sleep: float = 0.0) -> tuple[str, str]:
        import os
        import time

        time.sleep(sleep)
        return os.environ["KTLITE_POD_NAME"], type(self).version


class EchoV2(Echo):
    version = "v2"


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
def test_served_class_through_the_public_api(settings, deployments, make_compute, kube):
    """kt.cls(...).to(compute.autoscale(...)): calls go to one replica; a replica the HPA adds
    (played here) takes calls with the current code; a redeploy reaches every replica."""
    name = deployments.name("serve-api")
    compute = make_compute(launch_timeout=240).autoscale(min_scale=1, max_scale=2, concurrency=2)
    deployments.names.append(name)
    remote = kt.cls(Echo).to(compute, name=name)
    deployments.remotes.append(remote)
    pod, version = remote.who()
    assert version == "v1" and pod.startswith(f"{name}-")
    kube.apps.patch_namespaced_deployment(name, settings.namespace, {"spec": {"replicas": 2}})
    wait_for(
        lambda: len(remote.status()["replicas"]),
        lambda n: n == 2,
        240,
        "the client to route to 2 replicas",
    )
    answers = {f.result(timeout=120) for f in [remote.who.submit(sleep=1.0) for _ in range(4)]}
    assert {v for _, v in answers} == {"v1"} and len({p for p, _ in answers}) == 2
    pods = {r["name"] for r in remote.status()["replicas"]}
    second = kt.cls(EchoV2).to(compute, name=name)
    deployments.remotes.append(second)
    answers = {second.who() for _ in range(6)}
    assert {v for _, v in answers} == {"v2"} and {p for p, _ in answers} <= pods
    status = second.status()
    assert {r["name"] for r in status["replicas"]} == pods  # no replica restarted for new code
    print(f"\nstatus: {status['autoscaler']}")
    # the handle's scaling_status() is the HPA's own word; without a custom-metrics adapter it
    # scales on CPU in place of concurrency, and `ktlite status` says so
    said = second.scaling_status()
    assert said["autoscaler"] == "hpa" and (said["min"], said["max"]) == (1, 2)
    adapter = said["metric"]["name"] != "cpu"
    assert adapter or said["metric"]["instead_of"] == "concurrency", said
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "ktlite.commands.cli",
            "status",
            name,
            "--backend",
            "kubernetes",
            "-n",
            settings.namespace,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert (
        "metric ktlite_inflight_calls" if adapter else "metric cpu (target 80%"
    ) in shown.stdout, shown.stdout
    assert "metric concurrency" not in shown.stdout
