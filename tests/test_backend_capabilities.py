"""Optional backend capabilities are protocols checked once; no caller branches on a backend's name."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import ktlite
import ktlite as kt
from ktlite.backends.base import Applied, Backend, Plan
from ktlite.backends.capabilities import ClientScaling, Serving, Waking, optional, require
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.backends.local import LocalBackend
from ktlite.backends.registry import NAMES, backend_class, traits
from ktlite.specs.deployment_spec import DeploymentSpec


class BareBackend(Backend):
    """A backend with the five required methods and nothing optional."""

    name = "bare"

    def plan(self, spec: DeploymentSpec) -> Plan:
        return Plan(backend=self.name, name=spec.name, commands=[f"start {spec.workers} pod(s)"])

    def apply(self, spec: DeploymentSpec, token: str) -> Applied:
        raise kt.DeployError("the bare backend starts no pods")

    def lookup(self, name: str) -> Applied | None:
        return None

    def teardown(self, name: str, timeout: float = 30.0, volumes: bool = False) -> bool:
        return False

    def list(self) -> list[dict[str, Any]]:
        return []


def test_a_backend_lacking_a_capability_gets_an_error_naming_its_class() -> None:
    bare = BareBackend()
    assert optional(bare, Serving) is None and optional(bare, ClientScaling) is None
    with pytest.raises(
        kt.ConfigError,
        match=r"BareBackend \(backend 'bare'\) cannot serve autoscaled "
        r"deployments.*no autoscaler, write_launch",
    ):
        require(bare, Serving)
    with pytest.raises(
        kt.ConfigError, match=r"BareBackend .* no scale, lead_scaling, publish_waiting"
    ):
        require(bare, ClientScaling)


def test_each_backend_declares_what_it_does() -> None:
    local, kube = LocalBackend(), KubernetesBackend()
    assert require(local, Serving) is local and require(local, ClientScaling) is local
    assert optional(local, Waking) is None
    assert require(kube, Serving) is kube and require(kube, Waking) is kube
    assert optional(kube, ClientScaling) is None
    ssh = backend_class("ssh")
    assert not issubclass(ssh, Serving) and not issubclass(ssh, ClientScaling)


def test_a_partial_capability_is_no_capability() -> None:
    class HalfServing(BareBackend):
        def autoscaler(self, spec: DeploymentSpec) -> str:
            return "client"

    with pytest.raises(kt.ConfigError, match=r"HalfServing .* no write_launch \(Serving"):
        require(HalfServing(), Serving)


def test_traits_are_declared_without_importing_the_backend() -> None:
    assert set(NAMES) == {"local", "kubernetes", "ssh"}
    assert traits("ssh").hosts and not traits("ssh").serves and traits("ssh").store is None
    assert traits("local").local_files and not traits("local").pods_outlive_caller
    assert traits("kubernetes").existing_secrets and traits("kubernetes").store == "pod"
    assert traits(None) == traits("a-test-backend")  # names not registered: the defaults


def test_the_bare_backend_plans_and_says_where() -> None:
    spec = DeploymentSpec("bare", kt.Compute().pod_spec())
    assert str(BareBackend().plan(spec)).endswith("start 1 pod(s)")
    assert BareBackend().where() == "bare" and BareBackend().store_handoff() is None


# what callers wrote to tell backends apart: a name compared, a method probed
_BRANCH = re.compile(
    r"""backend\.name\s*[!=]=|backend\s*[!=]=\s*["']|(?:get|has)attr\([\w.]*backend\b"""
    r"""|[!=]=\s*["'](?:local|kubernetes|ssh)["']|["'](?:local|kubernetes|ssh)["']\s*[!=]="""
)


@pytest.mark.parametrize(
    "path", sorted(Path(ktlite.__file__).parent.glob("*.py")), ids=lambda p: p.name
)
def test_no_caller_branches_on_a_backend(path: Path) -> None:
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _BRANCH.search(line)
    ]
    assert found == [], "ask ktlite.backends.capabilities or registry.traits instead"
