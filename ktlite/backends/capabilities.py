"""Optional backend capabilities, declared as protocols and checked once per backend class.

Every backend starts, finds and stops pods (:class:`~ktlite.backends.base.Backend`). Some do
more, and callers ask for that here instead of probing a backend with ``hasattr``:

- :class:`Serving`: runs autoscaled deployments, keeping the current launch where replicas
  started later read it, with its generation (local, kubernetes).
- :class:`ClientScaling`: its replicas are scaled by ktlite's own autoscaler in the caller,
  one process leading (local).
- :class:`Waking`: a cluster autoscaler that scales to zero, woken for a call (kubernetes,
  with Knative).

:func:`require` returns the backend as the protocol or raises a ConfigError naming its
class; :func:`optional` returns it or None.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from ktlite.errors import ConfigError

if TYPE_CHECKING:
    from ktlite.backends.base import Applied
    from ktlite.specs.deployment_spec import DeploymentSpec
    from ktlite_wire.launch import Launch


@runtime_checkable
class Serving(Protocol):
    """Runs autoscaled deployments (their replicas are each a world of one pod)."""

    def autoscaler(self, spec: DeploymentSpec) -> str:
        """Who scales: ``"client"`` (ktlite's autoscaler in the caller, see
        :class:`ClientScaling`), or the cluster (``"hpa"``, ``"knative"``)."""
        ...

    def write_launch(self, name: str, launch: Launch) -> Launch:
        """Keep ``launch`` where replicas started later read it, as the next generation of
        ``name``'s launches; returns it with that generation. Taking the generation and
        writing the launch are one step (two ``.to()`` at once get two generations, and the
        launch kept is the one with the higher)."""
        ...


@runtime_checkable
class ClientScaling(Protocol):
    """Replicas that ktlite's own autoscaler scales: one calling process leads, the others
    publish the calls waiting in them."""

    def scale(self, name: str, token: str, replicas: int) -> Applied:
        """Run ``replicas`` replicas of ``name`` as deployed (the highest ordinals stop first)."""
        ...

    def lead_scaling(self, name: str) -> bool:
        """Whether this process is the one that scales ``name`` (it takes the lead if free)."""
        ...

    def publish_waiting(self, name: str, count: int) -> None:
        """Tell the leading process how many calls wait in this one."""
        ...

    def waiting_elsewhere(self, name: str) -> int:
        """The calls the other processes published as waiting."""
        ...

    def record_scaling(self, name: str, info: dict[str, Any]) -> None:
        """Keep the last decision where ``ktlite status`` (another process) reads it."""
        ...

    def supervise(self, name: str) -> None:
        """Scale a detached deployment from a process of its own, once the caller is gone."""
        ...


@runtime_checkable
class Waking(Protocol):
    """A cluster autoscaler that scales to zero replicas, and is woken for a call."""

    def wake(self, name: str, timeout: float) -> bool:
        """Ask the cluster for a replica of ``name``; True once one answers."""
        ...


P = TypeVar("P")
_WHAT = {
    Serving: "serve autoscaled deployments (.autoscale(), Compute(replicas=N))",
    ClientScaling: "let ktlite's autoscaler scale its replicas",
    Waking: "wake a deployment scaled to zero",
}


def _members(protocol: type) -> tuple[str, ...]:
    return tuple(
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and inspect.isfunction(value)
    )


_checked: dict[tuple[type, type], bool] = {}


def _has(cls: type, protocol: type) -> bool:
    """Checked once per backend class: every method of ``protocol`` is there."""
    key = (cls, protocol)
    if key not in _checked:
        _checked[key] = all(callable(getattr(cls, name, None)) for name in _members(protocol))
    return _checked[key]


def optional(backend: object, protocol: type[P]) -> P | None:
    """``backend`` as ``protocol`` where its class has every method of it, else None."""
    if _has(type(backend), protocol):
        return backend  # type: ignore[return-value]  # checked by _has, as isinstance would
    return None


def require(backend: object, protocol: type[P]) -> P:
    """``backend`` as ``protocol``; ConfigError naming its class and what it lacks otherwise."""
    found = optional(backend, protocol)
    if found is None:
        what = _WHAT.get(protocol, protocol.__name__)
        missing = [m for m in _members(protocol) if not callable(getattr(type(backend), m, None))]
        name = getattr(backend, "name", "?")
        raise ConfigError(
            f"{type(backend).__name__} (backend {name!r}) cannot {what}: it has no "
            f"{', '.join(missing)} ({protocol.__name__} in ktlite.backends.capabilities); "
            "use backend='local' or 'kubernetes'"
        )
    return found
