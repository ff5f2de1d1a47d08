"""The pod spec, pure: ``kt.Compute`` parsed once into the ``PodSpec`` a backend reads."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt
from ktlite.backends import kube_manifests as km
from ktlite.specs import podspec
from ktlite.specs.call_defaults import CallDefaults
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.kube_options import KubernetesOptions
from ktlite.specs.podspec import Memory, PodSpec, Resources


def _container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


def _render(spec: DeploymentSpec) -> list[dict[str, Any]]:
    return km.render(spec, "default", image="python:3.11-slim", install="ktlite", token="t0k")


@pytest.mark.parametrize(("cpus", "number"), [("500m", 0.5), (2, 2.0), ("1.5", 1.5), (0.25, 0.25)])
def test_cpus_are_a_number(cpus: Any, number: float) -> None:
    assert kt.Compute(cpus=cpus).pod_spec().resources.cpus == number


@pytest.mark.parametrize(
    ("memory", "size", "quantity"),
    [
        ("8GB", 8 * 10**9, "8G"),
        ("4Gi", 4 * 2**30, "4Gi"),
        ("512MiB", 512 * 2**20, "512Mi"),
        (1024, 1024, "1024"),
    ],
)
def test_memory_is_bytes_with_its_kubernetes_spelling(
    memory: Any, size: int, quantity: str
) -> None:
    res = kt.Compute(memory=memory, memory_limit=memory, shared_memory=memory).pod_spec().resources
    assert res.memory == res.memory_limit == res.shared_memory == Memory(size, quantity)


def test_limits_are_parsed_and_checked_against_requests() -> None:
    res = (
        kt.Compute(cpus="500m", cpu_limit=2, memory="1Gi", memory_limit="2Gi").pod_spec().resources
    )
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
    spec = DeploymentSpec("once", compute.pod_spec())
    assert spec.pod.resources is compute.resources
    assert _container(_render(spec))["resources"]["requests"]["cpu"] == "500m"
    assert len(calls) == before


def test_a_backend_plans_from_a_pod_spec_built_without_compute() -> None:
    pod = PodSpec(
        resources=Resources(cpus=0.5, memory=Memory.parse("4Gi"), gpus=1, gpu_type="A100"),
        env={"A": "1"},
        kubernetes=KubernetesOptions(node_selector={"pool": "gpu"}),
        calls=CallDefaults(launch_timeout=60),
    )
    objs = _render(DeploymentSpec("direct", pod=pod))
    container = _container(objs)
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "4Gi", "nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    assert {"name": "A", "value": "1"} in container["env"]
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {
        "pool": "gpu",
        "nvidia.com/gpu.product": "A100",
    }
    # the same settings through kt.Compute render the same objects
    same = kt.Compute(
        cpus="500m",
        memory="4Gi",
        gpus=1,
        gpu_type="A100",
        env={"A": "1"},
        node_selector={"pool": "gpu"},
        launch_timeout=60,
    )
    assert _render(DeploymentSpec("direct", same.pod_spec())) == objs


def test_a_deployment_spec_holds_a_pod_spec_never_the_callers_compute() -> None:
    """The spec is the parsed pods alone: a Compute given in their place is refused, naming
    the call that parses it; one built from a Compute keeps nothing of it."""
    compute = kt.Compute(cpus=1, env={"TOKEN": "s3cr3t-value"})
    with pytest.raises(kt.ConfigError, match=r"compute\.pod_spec\(\)") as info:
        DeploymentSpec("given-compute", compute)  # type: ignore[arg-type]
    assert "s3cr3t-value" not in str(info.value)
    spec = DeploymentSpec("parsed", compute.pod_spec())
    assert [f.name for f in dataclasses.fields(spec)] == [
        "name",
        "pod",
        "kind",
        "detached",
        "replicas",
    ]
    assert not any(isinstance(getattr(spec, f.name), kt.Compute) for f in dataclasses.fields(spec))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions (``from a import b`` as ``a``
    and, where ``a.b`` is a module, ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {
                f"{node.module}.{a.name}"
                for a in node.names
                if importlib.util.find_spec(node.module) is not None
                and node.module.startswith("ktlite")
                and _is_module(f"{node.module}.{a.name}")
            }
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


BACKENDS = sorted((Path(km.__file__).parent).glob("*.py"))


@pytest.mark.parametrize("path", BACKENDS, ids=lambda p: p.name)
def test_a_backend_imports_neither_compute_nor_the_package_face_nor_the_server(path: Path) -> None:
    imports = _imports(path)
    up = sorted(
        m
        for m in imports
        if m
        in (
            "ktlite",
            "ktlite.api.compute",
            "ktlite.api.remote",
            "ktlite.modes.deploy",
            "ktlite.api.decorators",
        )
        or m.split(".")[0] == "ktlite_server"
    )
    assert up == [], f"{path.name} imports {up}: a backend reads the pod spec only"


def test_the_backend_base_imports_no_backend() -> None:
    base = Path(km.__file__).parent / "base.py"
    backends = {f"ktlite.backends.{p.stem}" for p in BACKENDS} - {"ktlite.backends.base"}
    assert sorted(_imports(base) & backends) == []


def test_compute_keeps_its_parts_apart_and_reads_flat() -> None:
    c = kt.Compute(
        cpus=1, namespace="team", launch_timeout=30, replicas=2, service_account_name="sa"
    )
    assert c.kubernetes.namespace == c.namespace == "team"
    assert c.kubernetes.service_account == "sa" and c.service_account_name is None
    assert c.calls.launch_timeout == c.launch_timeout == 30
    assert c.serving.replicas == c.replicas == 2
    moved = c.distribute("pytorch", workers=2)
    assert moved.kubernetes.namespace == "team" and moved.serving.replicas == 2


@pytest.mark.parametrize(
    ("typo", "hint"),
    [
        ("cpu", "cpus"),
        ("memroy", "memory"),
        ("namespce", "namespace"),
        ("launch_timout", "launch_timeout"),
    ],
)
def test_a_mistyped_keyword_is_a_config_error_with_did_you_mean(typo: str, hint: str) -> None:
    with pytest.raises(kt.ConfigError, match=f"{typo!r} \\(did you mean {hint}\\?\\)"):
        kt.Compute(**{typo: 2})


def test_the_local_and_ssh_backends_plan_from_a_pod_spec_alone() -> None:
    from ktlite.backends.local import LocalBackend
    from ktlite.backends.ssh import SshBackend
    from ktlite.specs.hosts import Hosts
    from ktlite.specs.spec import DistributedConfig

    two = DistributedConfig(workers=2)
    local = str(
        LocalBackend().plan(
            DeploymentSpec("pod-only", pod=PodSpec(env={"A": "1"}, distributed=two))
        )
    )
    assert local.count("-m ktlite_server") == 2 and "A=..." in local
    hosts = PodSpec(backend="ssh", hosts=Hosts(("gpu1", "gpu2")), distributed=two)
    ssh = str(SshBackend().plan(DeploymentSpec("pod-only", pod=hosts)))
    assert "ssh gpu1:" in ssh and "ssh gpu2:" in ssh and "--ordinal 1" in ssh
