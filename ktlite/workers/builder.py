"""``WorkerBuilder`` (NeMo's ``RayWorkerBuilder``) and how a group's workers are placed.

``RayWorkerBuilder("pkg.module.PolicyWorker", config, lr=1e-5)`` names the worker class by
its import path and holds its constructor arguments. A worker group given one ships
:class:`BuiltWorker` instead of the class: on every rank it imports the class there (so the
driver never imports it: it may need packages only the pods have), unwraps a ``@ray.remote``
class, applies the class's ``configure_worker`` (its environment variables and extra
constructor keywords), and constructs it.

:class:`Placement` is NeMo's tied-worker layout: the workers in tied groups (by default
each worker alone), each group's first worker its data-parallel leader, and the
``worker_metadata`` NeMo's policies read.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ktlite.errors import ConfigError

logger = logging.getLogger(__name__)


def _check_fqn(fqn: Any) -> str:
    parts = fqn.split(".") if isinstance(fqn, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ConfigError(
            f"RayWorkerBuilder({fqn!r}): the worker class is named by its import path, "
            "'package.module.ClassName', importable on the pods"
        )
    return str(fqn)


class WorkerBuilder:
    """A worker class named by import path, with its constructor arguments (NeMo's
    ``RayWorkerBuilder``): ``RayWorkerGroup(cluster, RayWorkerBuilder(fqn, *args, **kwargs))``.

    The class is imported on the pods, not here: an installed package, one the image holds,
    or a local module this process has imported (ktlite ships those with the code).
    """

    def __init__(self, ray_actor_class_fqn: str, *args: Any, **kwargs: Any) -> None:
        self.ray_actor_class_fqn = _check_fqn(ray_actor_class_fqn)
        self.args = args
        self.kwargs = kwargs

    @property
    def class_name(self) -> str:
        return self.ray_actor_class_fqn.rsplit(".", 1)[1]

    def __repr__(self) -> str:  # the arguments may hold secrets: named, never shown
        keys = ", ".join(f"{k}=..." for k in self.kwargs)
        return f"RayWorkerBuilder({self.ray_actor_class_fqn!r}, <{len(self.args)} positional>{', ' if keys else ''}{keys})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            "a RayWorkerBuilder creates no Ray actor in ktlite: pass it to "
            "RayWorkerGroup(cluster, builder), which constructs the class on every rank"
        )


def unwrap_actor(obj: Any) -> Any:
    """The plain class behind a ``@ray.remote`` class (Ray's ActorClass); others as they are."""
    meta = getattr(obj, "__ray_metadata__", None)
    if meta is None or not hasattr(meta, "modified_class"):
        return obj
    return getattr(meta.modified_class, "__ray_actor_class__", meta.modified_class)


def load_class(fqn: str) -> Any:
    module_name, class_name = fqn.rsplit(".", 1)
    module = importlib.import_module(module_name)
    try:
        obj = getattr(module, class_name)
    except AttributeError:
        raise ImportError(
            f"RayWorkerBuilder({fqn!r}): module {module_name!r} has no {class_name!r}"
        ) from None
    return unwrap_actor(obj)


@dataclass(frozen=True)
class RankSetup:
    """What ``configure_worker`` is told on each rank (NeMo's arguments)."""

    num_gpus: float
    num_gpus_per_node: int
    bundle_indices: tuple[
        Any, ...
    ]  # by rank: (node, [local bundles]) for a group leader, else None


class BuiltWorker:
    """Shipped in place of a builder's class: constructing it on a rank returns the named
    class's instance (``__new__`` returns that object, so calls reach it directly)."""

    def __new__(
        cls, fqn: str, args: tuple[Any, ...], kwargs: dict[str, Any], setup: RankSetup
    ) -> Any:
        klass = load_class(fqn)
        kwargs = dict(kwargs)
        configure = getattr(klass, "configure_worker", None)
        if configure is not None:
            rank = int(os.environ.get("RANK", "0"))
            answer = configure(
                num_gpus=setup.num_gpus,
                bundle_indices=setup.bundle_indices[rank],
                num_gpus_per_node=setup.num_gpus_per_node,
            )
            if not isinstance(answer, (tuple, list)) or len(answer) not in (3, 4):
                raise TypeError(
                    f"{fqn}.configure_worker returned {type(answer).__name__}; NeMo's contract is a tuple "
                    "(resources, env_vars, init_kwargs, runtime_env_overrides)"
                )
            _, env_vars, init_kwargs, *rest = answer
            runtime_env = rest[0] if rest else None
            env = {**(env_vars or {}), **((runtime_env or {}).get("env_vars") or {})}
            os.environ.update({str(k): str(v) for k, v in env.items()})
            other = sorted(set(runtime_env or {}) - {"env_vars"})
            if other:  # Ray runtime_env keys (nsight, pip, ...) have no ktlite rank equivalent
                logger.warning(
                    "%s.configure_worker: runtime_env keys %s are Ray's; ignored on ktlite ranks",
                    fqn,
                    other,
                )
            kwargs.update(init_kwargs or {})
        return klass(*args, **kwargs)


@dataclass(frozen=True)
class Placement:
    """The workers of a group in tied groups of consecutive ranks on one pod each."""

    sizes: tuple[int, ...]
    groups: tuple[tuple[int, tuple[int, ...]], ...]  # (pod, local bundle indices), in rank order

    @property
    def leaders(self) -> list[int]:
        """The first worker of each tied group (its data-parallel leader), in order."""
        out, rank = [], 0
        for _, bundles in self.groups:
            out.append(rank)
            rank += len(bundles)
        return out

    def bundle_indices(self) -> tuple[Any, ...]:
        """By rank: ``(pod, [bundles])`` for a group's leader, None for the others."""
        out: list[Any] = []
        for pod, bundles in self.groups:
            out += [(pod, list(bundles))] + [None] * (len(bundles) - 1)
        return tuple(out)

    def metadata(self, prefix: str) -> list[dict[str, Any]]:
        """NeMo's ``worker_metadata``: one dict per worker, in rank order."""
        out, rank = [], 0
        for group, (pod, bundles) in enumerate(self.groups):
            for local, bundle in enumerate(bundles):
                name = (
                    f"{prefix}-grp{group}-{local}"
                    if len(bundles) > 1
                    else f"{prefix}-{pod}-{bundle}"
                )
                out.append(
                    {
                        "node_idx": pod,
                        "local_rank": local,
                        "global_rank": rank,
                        "name": name,
                        "bundle_indices": (pod, list(bundles)) if local == 0 else None,
                        "dp_shard_idx": group,
                    }
                )
                rank += 1
        return out


def placement(sizes: Sequence[int], workers_per_node: Any, bundle_indices_list: Any) -> Placement:
    """NeMo's ``workers_per_node`` / ``bundle_indices_list`` checked against the pods: a
    group spans every rank of its cluster, in pod order."""
    sizes = tuple(sizes)
    if workers_per_node is not None:
        per = (
            [workers_per_node] * len(sizes)
            if isinstance(workers_per_node, int)
            else workers_per_node
        )
        if (
            isinstance(workers_per_node, bool)
            or not isinstance(per, (list, tuple))
            or list(per) != list(sizes)
        ):
            raise ConfigError(
                f"workers_per_node={workers_per_node!r}: a ktlite worker group has one worker per rank of "
                f"its cluster, {list(sizes)}; leave it None (or give {list(sizes)}), and size the "
                "VirtualCluster to the workers you want"
            )
    if bundle_indices_list is None:
        return Placement(sizes, tuple((pod, (b,)) for pod, n in enumerate(sizes) for b in range(n)))
    try:
        groups = tuple(
            (int(pod), tuple(int(b) for b in bundles)) for pod, bundles in bundle_indices_list
        )
    except (TypeError, ValueError):
        raise ConfigError(
            f"bundle_indices_list={bundle_indices_list!r} must be a list of (node_idx, [bundle indices])"
        ) from None
    flat = [(pod, b) for pod, bundles in groups for b in bundles]
    want = [(pod, b) for pod, n in enumerate(sizes) for b in range(n)]
    if flat != want or any(not bundles for _, bundles in groups):
        raise ConfigError(
            f"bundle_indices_list={bundle_indices_list!r}: ktlite's ranks are fixed by pod, so the tied "
            f"groups must list every rank of the cluster {list(sizes)} once, in order (pod 0's bundles "
            "0..n-1, then pod 1's, ...), e.g. [(0, [0, 1]), (0, [2, 3]), (1, [0, 1]), (1, [2, 3])]"
        )
    return Placement(sizes, groups)


@dataclass(frozen=True)
class Shipment:
    """What a worker group deploys for its worker argument."""

    obj: Any  # the class kt.cls ships (BuiltWorker for a builder)
    init: Any  # its constructor arguments
    name: str  # the worker class's name
    by_path: bool  # a builder's: the class is not imported here


def shipment(worker: Any, args: tuple[Any, ...], init_args: Any, setup: RankSetup) -> Shipment:
    """A class (a ``@ray.remote`` one too) with its constructor arguments, or a builder."""
    worker = unwrap_actor(worker)
    if isinstance(worker, WorkerBuilder):
        if args or init_args is not None:
            raise ConfigError(
                f"{worker!r} holds the worker's constructor arguments: give them to RayWorkerBuilder, "
                "and the group's own options (workers_per_node=, name_prefix=, ...) by keyword"
            )
        init = (worker.ray_actor_class_fqn, worker.args, worker.kwargs, setup)
        return Shipment(BuiltWorker, init, worker.class_name, True)
    if isinstance(worker, type):
        if args and init_args is not None:
            raise ConfigError(
                "give the worker's constructor arguments either positionally or as init_args=, not both"
            )
        return Shipment(worker, tuple(args) if args else init_args, worker.__name__, False)
    raise ConfigError(
        f"WorkerGroup worker={worker!r}: give a class, or RayWorkerBuilder('module.Class', ...)"
    )
