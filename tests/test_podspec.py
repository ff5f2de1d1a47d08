"""The pod spec, pure: ``kt.Compute`` parsed once into the ``PodSpec`` a backend reads."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import ktlite as kt
from ktlite import podspec
from ktlite.backends import kube_manifests as km
from ktlite.call_defaults import CallDefaults
from ktlite.deployment_spec import DeploymentSpec
from ktlite.kube_options import KubernetesOptions
from ktlite.podspec import Memory, PodSpec, Resources


def _container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


def _render(spec: DeploymentSpec) -> list[dict[str, Any]]:
    return km.render(spec, "default", image="python:3.11-slim", install="ktlite", token="t0k")


@pytest.mark.parametrize(("cpus", "number"), [("500m", 0.5), (2, 2.0), ("1.5", 1.5), (0.25, 0.25)])
def test_cpus_are_a_number(cpus: Any, number: float) -> None:
    assert kt.Compute(cpus=cpus).pod_spec().resources.cpus == number


@pytest.mark.parametrize(("memory", "size", "quantity"), [
    ("8GB", 8 * 10**9, "8G"), ("4Gi", 4 * 2**30, "4Gi"), ("512MiB", 512 * 2**20, "512Mi"), (1024, 1024, "1024")])
def test_memory_is_bytes_with_its_kubernetes_spelling(memory: Any, size: int, quantity: str) -> None:
    res = kt.Compute(memory=memory, memory_limit=memory, shared_memory=memory).pod_spec().resources
    assert res.memory == res.memory_limit == res.shared_memory == Memory(size, quantity)


def test_limits_are_parsed_and_checked_against_requests() -> None:
    res = kt.Compute(cpus="500m", cpu_limit=2, memory="1Gi", memory_limit="2Gi").pod_spec().resources
    assert (res.cpu_limit, res.memory_limit) == (2.0, Memory(2 * 2**30, "2Gi"))
    with pytest.raises(kt.ConfigError, match="cpu_limit"):
        Resources(cpus=2.0, cpu_limit=1.0)
    with pytest.raises(kt.ConfigError, match="memory_limit"):
        Resources.parse(memory="2Gi", memory_limit="1Gi")
    with pytest.raises(kt.ConfigError, match="Resources.parse"):
        Resources(cpus="500m")  # type: ignore[arg-type]


def test_parsed_once_backends_never_parse_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real = podspec.parse_cpus

    def counting(value: Any, field_name: str = "cpus") -> float:
        calls.append(value)
        return real(value, field_name)

    monkeypatch.setattr(podspec, "parse_cpus", counting)
    compute = kt.Compute(cpus="500m").distribute("pytorch", workers=2)
    before = len(calls)
    spec = DeploymentSpec("once", compute)
    assert spec.pod.resources is compute.resources
    assert _container(_render(spec))["resources"]["requests"]["cpu"] == "500m"
    assert len(calls) == before


def test_a_backend_plans_from_a_pod_spec_built_without_compute() -> None:
    pod = PodSpec(resources=Resources(cpus=0.5, memory=Memory.parse("4Gi"), gpus=1, gpu_type="A100"),
                  env={"A": "1"}, kubernetes=KubernetesOptions(node_selector={"pool": "gpu"}),
                  calls=CallDefaults(launch_timeout=60))
    objs = _render(DeploymentSpec("direct", pod=pod))
    container = _container(objs)
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "4Gi", "nvidia.com/gpu": "1"},
                                      "limits": {"nvidia.com/gpu": "1"}}
    assert {"name": "A", "value": "1"} in container["env"]
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "A100"}
    # the same settings through kt.Compute render the same objects
    same = kt.Compute(cpus="500m", memory="4Gi", gpus=1, gpu_type="A100", env={"A": "1"},
                      node_selector={"pool": "gpu"}, launch_timeout=60)
    assert _render(DeploymentSpec("direct", same)) == objs


def test_a_deployment_spec_needs_a_compute_or_a_pod_spec() -> None:
    with pytest.raises(kt.ConfigError, match="compute= .* or pod="):
        DeploymentSpec("nothing")


def test_backends_import_no_compute_and_no_package_face() -> None:
    code = ("import sys; import ktlite.backends.kube_manifests, ktlite.backends.local, ktlite.backends.registry; "
            "import ktlite.backends.kubernetes; bad = [m for m in ('ktlite.compute', 'ktlite.remote', "
            "'ktlite.deploy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compute_keeps_its_parts_apart_and_reads_flat() -> None:
    c = kt.Compute(cpus=1, namespace="team", launch_timeout=30, replicas=2, service_account_name="sa")
    assert c.kubernetes.namespace == c.namespace == "team"
    assert c.kubernetes.service_account == "sa" and c.service_account_name is None
    assert c.calls.launch_timeout == c.launch_timeout == 30
    assert c.serving.replicas == c.replicas == 2
    moved = c.distribute("pytorch", workers=2)
    assert moved.kubernetes.namespace == "team" and moved.serving.replicas == 2


@pytest.mark.parametrize(("typo", "hint"), [("cpu", "cpus"), ("memroy", "memory"), ("namespce", "namespace"),
                                            ("launch_timout", "launch_timeout")])
def test_a_mistyped_keyword_is_a_config_error_with_did_you_mean(typo: str, hint: str) -> None:
    with pytest.raises(kt.ConfigError, match=f"{typo!r} \\(did you mean {hint}\\?\\)"):
        kt.Compute(**{typo: 2})
