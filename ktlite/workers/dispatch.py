"""NeMo RL's call keywords for worker groups: which workers a call reaches, with what data,
and which of their results the caller gets back.

Worker indices are ranks. A layout (``NamedSharding``) names axes over them; the keywords
read it:

- ``run_rank_0_only_axes=["tp"]``: only workers at coordinate 0 of those axes run the call.
- ``run_all_workers_sharded_data(..., in_sharded_axes=, replicate_on_axes=)``: each data
  argument is a nested list, one level per sharded axis; a worker gets the item at its
  coordinates. Replicated axes get the same item. Workers off coordinate 0 of a *free* axis
  (in neither list) are not called, or called with ``None`` for every data argument when
  ``make_dummy_calls_to_free_axes=True`` (so that they join the collectives).
- ``output_is_replicated=["tp"]``: only workers at coordinate 0 of those axes (and of the
  free axes) return their result; the others ran, but their copies are dropped.
- ``common_kwargs``: the same keyword arguments for every called worker.

:class:`MultiWorkerFuture` carries a sharded call's future with the called and returning
workers, as NeMo's does; ``WorkerGroup.get_all_worker_results`` waits for it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ktlite.errors import ConfigError


def _axes(sharding: Any, axes: Any, keyword: str) -> list[str]:
    if axes is None:
        return []
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise ConfigError(
            f"{keyword}={axes!r} must be a list of axis names, e.g. ['tensor_parallel']"
        )
    if axes and sharding is None:
        raise ConfigError(
            f"{keyword}={list(axes)} needs the group's layout: make the group with "
            "sharding_annotations=NamedSharding(...)"
        )
    unknown = [a for a in axes if a not in sharding.names] if axes else []
    if unknown:
        raise ConfigError(
            f"{keyword}: axis(es) {unknown} are not in the layout's axes {sharding.names}"
        )
    return list(axes)


def rank0_only(sharding: Any, world: int, axes: Any) -> list[int]:
    """The workers at coordinate 0 of every axis in ``axes`` (every worker when it is empty)."""
    axes = _axes(sharding, axes, "run_rank_0_only_axes")
    if not axes:
        return list(range(world))
    return [w for w in range(world) if all(sharding.get_worker_coords(w)[a] == 0 for a in axes)]


@dataclass(frozen=True)
class ShardedCall:
    """The plan of one sharded call: who runs it with which data, and whose results count."""

    called: list[int]
    returned: list[int]
    args: dict[int, tuple[Any, ...]]  # worker -> its positional arguments
    kwargs: dict[int, dict[str, Any]]  # worker -> its keyword arguments (common ones not included)

    def per_rank(self, world: int) -> tuple[list[list[Any]], dict[str, list[Any]]]:
        """Each argument as one item per rank (None where a rank is not called)."""
        npos = len(next(iter(self.args.values()), ()))
        keys = list(next(iter(self.kwargs.values()), {}))
        args = [
            [self.args[r][i] if r in self.args else None for r in range(world)] for i in range(npos)
        ]
        kwargs = {
            k: [self.kwargs[r][k] if r in self.kwargs else None for r in range(world)] for k in keys
        }
        return args, kwargs


def _pick(
    value: Any, coords: dict[str, int], axes: list[str], sizes: dict[str, int], where: str
) -> Any:
    for axis in axes:
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
            raise ConfigError(
                f"{where} must be nested lists with one level per sharded axis ({axes}); at axis "
                f"{axis!r} it is a {type(value).__name__}"
            )
        if len(value) != sizes[axis]:
            raise ConfigError(
                f"{where} has {len(value)} item(s) along axis {axis!r}, whose size is {sizes[axis]}"
            )
        value = value[coords[axis]]
    return value


def plan_sharded(
    sharding: Any,
    world: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_sharded_axes: Any,
    replicate_on_axes: Any,
    output_is_replicated: Any,
    make_dummy_calls_to_free_axes: bool,
) -> ShardedCall:
    """NeMo's ``run_all_workers_sharded_data`` dispatch, checked before anything is sent."""
    if sharding is None:
        raise ConfigError(
            "run_all_workers_sharded_data needs the group's layout: make the group with "
            "sharding_annotations=NamedSharding(layout, names) (or pass layout={'dp': 2, 'tp': 2})"
        )
    sharded = _axes(sharding, in_sharded_axes, "in_sharded_axes")
    replicated = _axes(sharding, replicate_on_axes, "replicate_on_axes")
    dropped = _axes(sharding, output_is_replicated, "output_is_replicated")
    both = sorted(set(sharded) & set(replicated))
    if both:
        raise ConfigError(f"axis(es) {both} are both in in_sharded_axes and replicate_on_axes")
    free = [a for a in sharding.names if a not in sharded and a not in replicated]
    sizes = {a: sharding.get_axis_size(a) for a in sharding.names}
    plan = ShardedCall([], [], {}, {})
    for w in range(world):
        coords = sharding.get_worker_coords(w)
        gets_data = all(coords[a] == 0 for a in free)
        if gets_data and all(coords[a] == 0 for a in dropped):
            plan.returned.append(w)
        if gets_data:
            plan.args[w] = tuple(
                _pick(v, coords, sharded, sizes, f"positional argument {i}")
                for i, v in enumerate(args)
            )
            plan.kwargs[w] = {
                k: _pick(v, coords, sharded, sizes, f"argument {k!r}") for k, v in kwargs.items()
            }
        elif make_dummy_calls_to_free_axes:
            plan.args[w] = (None,) * len(args)
            plan.kwargs[w] = dict.fromkeys(kwargs)
        else:
            continue
        plan.called.append(w)
    return plan


class MultiWorkerFuture:
    """The results of a sharded call, still coming: ``result(timeout)`` (or the group's
    ``get_all_worker_results(bundle)``) gives those of ``return_from_workers``, in worker
    order."""

    def __init__(
        self, future: Any, called_workers: list[int], return_from_workers: list[int]
    ) -> None:
        self.future = future  # a kt.Future of the called workers' results, in worker order
        self.called_workers = called_workers
        self.return_from_workers = return_from_workers

    def __repr__(self) -> str:
        return (
            f"<MultiWorkerFuture called={self.called_workers} return_from={self.return_from_workers} "
            f"{'done' if self.done() else 'running'}>"
        )

    @property
    def futures(self) -> list[Any]:
        return [self.future]

    def done(self) -> bool:
        return bool(self.future.done())

    def result(self, timeout: float | None = None) -> list[Any]:
        values = self.future.result(timeout)
        at = {w: i for i, w in enumerate(self.called_workers)}
        return [values[at[w]] for w in self.return_from_workers if w in at]

    def get_results(
        self, worker_group: Any = None, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        _no_proxies(return_generators_as_proxies)
        return self.result()

    def __await__(self) -> Any:
        return (yield from _await_result(self).__await__())


class First:
    """A future of one worker's result over a future of the list ktlite returns."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> Any:
        return self._future.result(timeout)[0]

    def done(self) -> bool:
        return bool(self._future.done())

    def __await__(self) -> Any:
        return (yield from _await_first(self._future).__await__())


async def _await_first(future: Any) -> Any:
    return (await future)[0]


async def _await_result(bundle: MultiWorkerFuture) -> list[Any]:
    await bundle.future
    return bundle.result()


def _no_proxies(return_generators_as_proxies: bool) -> None:
    if return_generators_as_proxies:
        raise ConfigError(
            "return_generators_as_proxies=True: ktlite worker methods return values, not Ray object "
            "generators; call without it (the results come back as a list)"
        )


_PENDING = (concurrent.futures.Future, First, MultiWorkerFuture)


def wait_results(
    bundle: Any, timeout: float | None, return_generators_as_proxies: bool = False
) -> Any:
    """What a ``run_*`` method returned, waited for: a future's value, a bundle's results, each
    of a list's futures in turn; results already in hand as they are."""
    _no_proxies(return_generators_as_proxies)
    if isinstance(bundle, _PENDING):
        return bundle.result(timeout)
    if isinstance(bundle, (list, tuple)):
        return [f.result(timeout) if isinstance(f, _PENDING) else f for f in bundle]
    return bundle
