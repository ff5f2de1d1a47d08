"""Handles on running deployments whose code is not here: ``kt.fn(name="svc")``,
``kt.cls(name="svc")`` (deployed by another process, a notebook or ``ktlite deploy``)."""

from __future__ import annotations

from typing import Any

from ktlite.api.compute import Compute
from ktlite.api.handles import RemoteClass, RemoteFunction
from ktlite.backends.registry import get_backend
from ktlite.errors import ConfigError, NotDeployedError
from ktlite.modes.deploy import Deployment
from ktlite.net.client import PodClient
from ktlite.specs.autoscaling import AutoscaleConfig
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.spec import DistributedConfig, check_name


def _layout(status: dict[str, Any], pods: int) -> DistributedConfig:
    """The running deployment's layout, as its pod 0 reports it."""
    layout = status.get("layout") or {}
    if layout.get("distributed"):
        return DistributedConfig(**layout["distributed"])
    return DistributedConfig(workers=pods, num_proc=max(1, len(status.get("ranks") or [])))


def _check_kind(name: str, kind: str, running: Any) -> None:
    if running not in (None, kind):
        raise ConfigError(
            f"{name!r} runs a {'class' if running == 'cls' else 'function'}: attach with "
            f"kt.{'cls' if running == 'cls' else 'fn'}(name={name!r})"
        )


def _reattach(
    kind: str, name: str, backend: str | None = None, namespace: str | None = None
) -> RemoteFunction | RemoteClass:
    """``kt.fn(name="svc")`` / ``kt.cls(name="svc")``: a handle on a running deployment whose
    code is not here (deployed by another process, notebook or ``ktlite deploy``). Its spec
    (and with it its mode) is what the running deployment reports."""
    name = check_name(name)
    be = get_backend(backend, namespace)
    applied = be.lookup(name)
    if applied is None:
        raise NotDeployedError(
            f"no deployment {name!r} on backend {be.name!r} to attach to; deploy it "
            f"with kt.{kind}(obj).to(compute) or `ktlite deploy` (`ktlite list` shows "
            "what runs)"
        )
    client = PodClient(applied.token, http=applied.http)
    try:
        if applied.autoscale is not None:  # replicas (maybe none now), each a world of one
            compute = Compute(
                backend=be.name,
                namespace=namespace,
                autoscaling=AutoscaleConfig(**applied.autoscale),
            )
            if applied.endpoints:
                _check_kind(name, kind, client.status(applied.endpoints[0].url).get("kind"))
        else:
            status = client.status(applied.endpoints[0].url)
            _check_kind(name, kind, status.get("kind"))
            single = bool((status.get("layout") or {}).get("single"))
            compute = Compute(
                backend=be.name,
                namespace=namespace,
                distributed=None if single else _layout(status, len(applied.endpoints)),
            )
    except BaseException:
        client.close()
        raise
    spec = DeploymentSpec(name, pod=compute.pod_spec(), kind=kind)
    dep = Deployment(spec, be, applied, client=client)
    dep.mode.adopt()
    source = _Named(kind, name)
    if kind == "cls":
        return RemoteClass(source, dep, None, compute=compute)
    return RemoteFunction(source, dep, compute=compute)


def _attach_by_name(
    kind: str, name: str | None, get_if_exists: bool
) -> RemoteFunction | RemoteClass:
    """``kt.fn(name=...)`` / ``kt.cls(name=...)`` with no code: the running deployment."""
    what = "function" if kind == "fn" else "class"
    if name is None:
        raise ConfigError(
            f"kt.{kind}() needs a {what}, or name= of a running deployment to attach to"
        )
    if not get_if_exists:
        raise ConfigError(
            f"kt.{kind}(name={name!r}, get_if_exists=False) has nothing to deploy: pass the {what}"
        )
    return _reattach(kind, name)


class _Named:
    """The source of a deployment attached by name: its code is on the pods, not here."""

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.obj, self.name = kind, None, name

    def __repr__(self) -> str:
        return f"kt.{self.kind}(name={self.name!r})"

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"{self!r} was attached by name and its code is not here: deploy it again "
            f"from kt.{self.kind}(obj, name={self.name!r})"
        )
