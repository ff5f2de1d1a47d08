"""NeMo RL's worker-group API over ktlite: ``VirtualCluster`` and ``WorkerGroup``.

A face for code written against NeMo RL's ``RayVirtualCluster``/``RayWorkerGroup``: change
the import and it runs on ktlite's pods (local processes or Kubernetes), no Ray. Each
method is a few lines over ktlite's own calls, which say more about the behaviour:

==================================  ==============================================
NeMo                                 ktlite
==================================  ==============================================
``VirtualCluster([4, 8, 2])``        ``Compute(...).distribute("pytorch", num_proc=[4, 8, 2])``
``WorkerGroup(cluster, Worker)``     ``kt.cls(Worker).to(compute, init_args=...)``
``RayWorkerBuilder(fqn, *a, **kw)``  the class imported and constructed on each rank
second group on the same cluster     ``kt.cls(Gen).to(first_group_remote)`` (colocation)
``run_all_workers_single_data``      ``remote.method(*args, **kwargs)``
``run_all_workers_multiple_data``    ``remote.method(kt.per_rank(items), ...)``
``run_all_workers_sharded_data``     per-rank items to the ranks chosen (``ktlite.workers.dispatch``)
``run_single_worker_single_data``    ``remote.method.options(ranks=[i])(...)``
futures, ``get_all_worker_results``  ``remote.method.submit(...)``, ``Future.result()``
``restart_failed_workers``           ``remote.restart_failed()``
``get_worker_status`` & co           ``remote.status()``
==================================  ==============================================

Example:
    >>> from ktlite.groups import VirtualCluster, WorkerGroup
    >>> cluster = VirtualCluster([2, 2], max_colocated_worker_groups=2)
    >>> policy = WorkerGroup(cluster, PolicyWorker, init_args={"lr": 1e-3})
    >>> losses = policy.run_all_workers_single_data("train_step", batch)      # one per worker
    >>> gen = WorkerGroup(cluster, GenerationWorker)                          # same processes
    >>> outs = gen.run_all_workers_multiple_data("generate", prompts)         # prompts[r] to rank r
    >>> cluster.shutdown()
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

from ktlite.api.sharding import NamedSharding, check_layout, row_major
from ktlite.errors import ConfigError, RemoteError
from ktlite.specs.spec import default_name
from ktlite.workers.batched import BatchedDataDict, SlicedDataDict
from ktlite.workers.builder import RankSetup, WorkerBuilder, placement, shipment
from ktlite.workers.dispatch import First, MultiWorkerFuture, plan_sharded, rank0_only, wait_results
from ktlite.workers.virtual_cluster import VirtualCluster, refuse_options

logger = logging.getLogger(__name__)

WorkerFailureError = RemoteError  # what a call raises when a worker failed or died

_GROUP_REFUSED = {
    "enable_gradient_compression": "compress gradients in your own training code (e.g. a DDP comm hook)",
    "async_communication": "use run_all_workers_single_data(..., _async=True) futures instead",
    "enable_load_balancing": "a worker group calls every worker; for load-balanced serving use a "
    "single-rank kt.cls with Compute(concurrency=K)",
    "load_balancing_strategy": "a worker group calls every worker",
}
_GROUP_OPTIONS = (
    "cluster",
    "remote_worker_builder",
    "worker_class",
    "init_args",
    "workers_per_node",
    "name_prefix",
    "bundle_indices_list",
    "sharding_annotations",
    "env_vars",
    "max_restarts",
    "restart_on_failure",
    "memory_limit",
    "concurrency",
)


def _any_method(*args: Any, **kwargs: Any) -> Any:
    """Stands for a builder's method, whose class is not imported here: every keyword of a
    call belongs to the worker method (none is taken as a ktlite call option)."""


class WorkerGroup:
    """One instance of the worker class per rank of ``cluster``, called all together.

    The first group on a cluster deploys its pods; later ones (up to
    ``max_colocated_worker_groups``) are colocated into the same rank processes: they share
    the pods, the GPUs, the process (so also its ``torch.distributed`` process group) and the
    order of calls (groups run in turn), not their instance state.

    Args:
        cluster: the :class:`VirtualCluster`.
        remote_worker_builder: the worker: a class (a ``@ray.remote`` one too), or a
            :class:`RayWorkerBuilder` naming the class by import path with its constructor
            arguments (the class is then imported on the pods only). ``worker_class=`` also.
        *args, init_args: a class's constructor arguments (positional, or ``init_args=`` a
            dict/tuple).
        workers_per_node, bundle_indices_list: NeMo's worker layout; a group has one worker
            per rank, in pod order; tied groups (``[(node, [bundles]), ...]``) set
            ``dp_size``, ``get_dp_leader_worker_idx`` and ``worker_metadata``.
        sharding_annotations: a :class:`NamedSharding` over the workers, read by
            ``run_rank_0_only_axes`` and ``run_all_workers_sharded_data``.
        env_vars: environment variables for every rank (first group only: a colocated group
            shares its host's processes and environment).
        name_prefix: the group's name (default: the class's name).
        max_restarts: how often a dead rank is restarted automatically before a call.
        restart_on_failure: restart dead ranks automatically at the next call (default) or
            only when :meth:`restart_failed_workers` is called.
        memory_limit: memory limit per worker, e.g. "8Gi" (the pod's limit is this times its
            ranks; first group only).
        concurrency: calls that may run at once on each rank (1 for distributed groups).
    """

    def __init__(
        self,
        cluster: VirtualCluster,
        remote_worker_builder: Any = None,
        *args: Any,
        worker_class: Any = None,
        init_args: Any = None,
        workers_per_node: int | list[int] | None = None,
        name_prefix: str | None = None,
        bundle_indices_list: list[tuple[int, list[int]]] | None = None,
        sharding_annotations: Any = None,
        env_vars: dict[str, str] | None = None,
        max_restarts: int | None = None,
        restart_on_failure: bool = True,
        memory_limit: str | None = None,
        concurrency: int | None = None,
        **unknown: Any,
    ) -> None:
        refuse_options("WorkerGroup", unknown, _GROUP_REFUSED, _GROUP_OPTIONS)
        if not isinstance(cluster, VirtualCluster):
            raise ConfigError(f"WorkerGroup needs a VirtualCluster, got {type(cluster).__name__}")
        if (remote_worker_builder is None) == (worker_class is None):
            raise ConfigError(
                "WorkerGroup(cluster, worker): give the worker class or RayWorkerBuilder once"
            )
        if len(cluster.groups) >= cluster.max_colocated_worker_groups:
            raise ConfigError(
                f"{cluster!r} already holds {len(cluster.groups)} worker group(s), its maximum; make it with "
                f"max_colocated_worker_groups={len(cluster.groups) + 1} (or enable_colocation=True) to "
                "colocate another group on the same ranks, or use a second VirtualCluster for new pods"
            )
        self._placement = placement(cluster.sizes, workers_per_node, bundle_indices_list)
        self.sharding_annotations = check_layout(sharding_annotations, cluster.world_size())
        self.cluster = cluster
        self.restart_on_failure = restart_on_failure
        setup = RankSetup(
            num_gpus=1 / cluster.max_colocated_worker_groups if cluster.use_gpus else 0,
            num_gpus_per_node=cluster.num_gpus_per_node,
            bundle_indices=self._placement.bundle_indices(),
        )
        self.worker_class = remote_worker_builder if worker_class is None else worker_class
        self._shipment = shipment(self.worker_class, args, init_args, setup)
        self.name = name_prefix or self._shipment.name
        self.name_prefix = self.name
        self._remote = self._deploy(env_vars, memory_limit, max_restarts, concurrency)
        cluster.groups.append(self)

    def _deploy(self, env_vars: Any, memory_limit: Any, max_restarts: Any, concurrency: Any) -> Any:
        import ktlite as kt

        cluster, ship = self.cluster, self._shipment
        host = cluster._host()
        if host is not None:
            if env_vars or memory_limit or max_restarts is not None or concurrency is not None:
                raise ConfigError(
                    f"WorkerGroup({self.name}) is colocated with {host.name!r}: it shares that group's "
                    "processes, so env_vars, memory_limit, max_restarts and concurrency belong on the "
                    "first group"
                )
            return kt.cls(ship.obj).to(host, init_args=ship.init, name=default_name(self.name))
        compute = cluster.group_compute(
            env_vars, memory_limit, max_restarts, concurrency, self.restart_on_failure
        )
        source = kt.cls(ship.obj, name=cluster.name or default_name(self.name))
        return source.to(compute, init_args=ship.init)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name}, ranks={self.world_size}, cluster={self.cluster.sizes})"

    @property
    def remote(self) -> Any:
        """The ktlite :class:`RemoteClass` behind this group."""
        if self._remote is None:
            raise ConfigError(f"worker group {self.name!r} was shut down")
        return self._remote

    @property
    def workers(self) -> list[int]:
        return list(range(self.cluster.world_size()))

    @property
    def world_size(self) -> int:
        return self.cluster.world_size()

    @property
    def worker_metadata(self) -> list[dict[str, Any]]:
        """Per worker, in rank order: ``node_idx``, ``local_rank`` (in its tied group),
        ``global_rank``, ``name``, ``bundle_indices`` (leaders only) and ``dp_shard_idx``."""
        return self._placement.metadata(self.name)

    @property
    def dp_leader_worker_indices(self) -> list[int]:
        return self._placement.leaders

    @property
    def dp_size(self) -> int:
        """The number of tied groups (data-parallel shards): each worker alone by default."""
        return len(self._placement.leaders)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        """The first worker of tied group ``dp_shard_idx``."""
        leaders = self._placement.leaders
        if (
            isinstance(dp_shard_idx, bool)
            or not isinstance(dp_shard_idx, int)
            or not 0 <= dp_shard_idx < len(leaders)
        ):
            raise IndexError(
                f"dp_shard_idx={dp_shard_idx!r} is out of range: this group has {len(leaders)} shard(s)"
            )
        return leaders[dp_shard_idx]

    def _method(self, method_name: str, ranks: list[int] | None = None) -> Any:
        from ktlite.api.adverbs import RemoteMethod

        if not isinstance(method_name, str):
            raise ConfigError(
                f"method_name={method_name!r} must be the name of a method of the worker class"
            )
        method = (
            RemoteMethod(self.remote, method_name, _any_method)
            if self._shipment.by_path
            else getattr(self.remote, method_name)
        )
        return (
            method
            if ranks is None or len(ranks) == self.world_size
            else method.options(ranks=ranks)
        )

    @staticmethod
    def _run(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _async: bool) -> Any:
        return method.submit(*args, **kwargs) if _async else method(*args, **kwargs)

    def run_all_workers_single_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: Sequence[str] | None = None,
        _async: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Call ``method_name(*args, **kwargs)`` on every worker (only those at coordinate 0 of
        ``run_rank_0_only_axes``): their results in worker order (a future of them with
        ``_async=True``)."""
        called = rank0_only(self.sharding_annotations, self.world_size, run_rank_0_only_axes)
        return self._run(self._method(method_name, called), args, kwargs, _async)

    def run_all_workers_multiple_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: Sequence[str] | None = None,
        common_kwargs: dict[str, Any] | None = None,
        _async: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Each positional and keyword argument is a list with one item per called worker
        (every worker, or those at coordinate 0 of ``run_rank_0_only_axes``); the i-th called
        worker gets item i of each, and only that item reaches its pod. ``common_kwargs`` go
        to every called worker."""
        import ktlite as kt

        called = rank0_only(self.sharding_annotations, self.world_size, run_rank_0_only_axes)
        for key, value in list(enumerate(args)) + list(kwargs.items()):
            if (
                isinstance(value, (str, bytes))
                or not isinstance(value, Sequence)
                or len(value) != len(called)
            ):
                raise ConfigError(
                    f"run_all_workers_multiple_data: argument {key!r} must be a list with one item per "
                    f"worker called ({len(called)}); pass shared values in common_kwargs="
                )
        shared = dict(common_kwargs or {})
        clash = sorted(set(shared) & set(kwargs))
        if clash:
            raise ConfigError(
                f"run_all_workers_multiple_data: {', '.join(clash)} given both per worker and in common_kwargs"
            )

        def spread(items: Sequence[Any]) -> Any:
            at = dict(zip(called, items, strict=True))
            return kt.per_rank([at.get(r) for r in range(self.world_size)])

        call_kwargs = {**{k: spread(v) for k, v in kwargs.items()}, **shared}
        return self._run(
            self._method(method_name, called), tuple(spread(a) for a in args), call_kwargs, _async
        )

    def run_all_workers_sharded_data(
        self,
        method_name: str,
        *args: Any,
        in_sharded_axes: Sequence[str] | None = None,
        replicate_on_axes: Sequence[str] | None = None,
        output_is_replicated: Sequence[str] | None = None,
        make_dummy_calls_to_free_axes: bool = False,
        common_kwargs: dict[str, Any] | None = None,
        layout: dict[str, int] | None = None,
        **kwargs: Any,
    ) -> MultiWorkerFuture:
        """NeMo's sharded dispatch over the group's ``sharding_annotations`` (or ``layout={"dp":
        2, "tp": 2}``): each argument is nested lists, one level per axis of
        ``in_sharded_axes``; a worker gets the item at its coordinates, the same one along
        ``replicate_on_axes``. Workers off coordinate 0 of the other (free) axes are not
        called, or called with None for each argument with ``make_dummy_calls_to_free_axes``.
        Returns at once; ``get_all_worker_results(bundle)`` gives the results of the workers at
        coordinate 0 of the free axes and of ``output_is_replicated``, in worker order."""
        import ktlite as kt

        sharding = row_major(layout) if layout is not None else self.sharding_annotations
        if layout is not None:
            check_layout(sharding, self.world_size)
        plan = plan_sharded(
            sharding,
            self.world_size,
            args,
            kwargs,
            in_sharded_axes,
            replicate_on_axes,
            output_is_replicated,
            make_dummy_calls_to_free_axes,
        )
        shared = dict(common_kwargs or {})
        clash = sorted(set(shared) & set(kwargs))
        if clash:
            raise ConfigError(
                f"run_all_workers_sharded_data: {', '.join(clash)} given both sharded and in common_kwargs"
            )
        per_args, per_kwargs = plan.per_rank(self.world_size)
        call_args = tuple(kt.per_rank(items) for items in per_args)
        call_kwargs = {k: kt.per_rank(items) for k, items in per_kwargs.items()}
        future = self._method(method_name, plan.called).submit(*call_args, **call_kwargs, **shared)
        return MultiWorkerFuture(future, plan.called, plan.returned)

    def run_single_worker_single_data(
        self, method_name: str, worker_idx: int, *args: Any, _async: bool = False, **kwargs: Any
    ) -> Any:
        """Call ``method_name`` on worker ``worker_idx`` only: its result (a future of it with
        ``_async=True``)."""
        if (
            isinstance(worker_idx, bool)
            or not isinstance(worker_idx, int)
            or not 0 <= worker_idx < self.world_size
        ):
            raise ConfigError(
                f"worker_idx={worker_idx!r} must be between 0 and {self.world_size - 1}"
            )
        bound = self._method(method_name).options(ranks=[worker_idx])
        if _async:
            return First(bound.submit(*args, **kwargs))
        return bound(*args, **kwargs)[0]

    def get_all_worker_results(
        self,
        future_bundle: Any,
        return_generators_as_proxies: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Wait for what a ``run_*`` method returned: a sharded call's bundle (its returning
        workers' results), a future, a list of futures, or results already in hand."""
        return wait_results(future_bundle, timeout, return_generators_as_proxies)

    def restart_failed_workers(self) -> list[int]:
        """Restart the worker processes that died (only those: the others keep their state);
        the restarted ranks, in order."""
        restarted: list[int] = self.remote.restart_failed()["restarted"]
        return restarted

    def _ranks(self, stuck_after: float | None = None) -> list[dict[str, Any]]:
        rows = [
            {**r, "pod": pod["pod"]}
            for pod in self.remote.status(stuck_after)
            for r in pod.get("ranks", [])
        ]
        return sorted(rows, key=lambda r: r["rank"])

    def get_worker_status(self) -> list[dict[str, Any]]:
        """One dict per worker (rank), in rank order: pod, state, pid, restarts, last exit, the
        calls it runs and for how long (``remote.status()`` flattened)."""
        return self._ranks()

    def detect_stuck_workers(self, threshold_s: float = 600.0) -> list[int]:
        """The workers busy with one call for longer than ``threshold_s`` seconds."""
        return [r["rank"] for r in self._ranks(threshold_s) if r.get("stuck")]

    def get_resource_usage(self) -> list[dict[str, Any]]:
        """Per worker: pid, CPU %, RSS bytes, and GPU memory/utilisation where GPUs exist
        (None where the pod has no ``nvidia-smi``)."""
        keys = ("rank", "pod", "pid", "cpu_percent", "rss_bytes", "gpu_memory_used_bytes",
                "gpu_memory_total_bytes", "gpu_utilization_percent")  # fmt: skip
        return [{k: r.get(k) for k in keys} for r in self._ranks()]

    def shutdown(
        self, cleanup_method: str | None = None, timeout: float | None = 30.0, force: bool = False
    ) -> bool:
        """Remove this group's workers (a colocated group leaves its host's pods running; the
        first group takes the pods and every group on them down). With ``cleanup_method``
        (and not ``force``) that method runs on every worker first, for up to ``timeout``
        seconds (None: until it ends); False when it failed or ran out of time, after which
        the workers are removed all the same."""
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ConfigError(
                f"shutdown(timeout={timeout!r}): give a number of seconds > 0, or None to wait"
            )
        if self._remote is None:
            return True
        success = True
        if cleanup_method is not None and not force:
            future = self._method(cleanup_method).submit()
            try:
                future.result(timeout)
            except concurrent.futures.TimeoutError:
                success = False
                future.cancel()
                logger.warning(
                    "%s.%s did not end within %ss; removing the workers anyway",
                    self.name,
                    cleanup_method,
                    timeout,
                )
            except Exception as e:  # noqa: BLE001 - the workers are removed whatever the cleanup did
                success = False
                logger.warning(
                    "%s.%s failed (%s); removing the workers anyway",
                    self.name,
                    cleanup_method,
                    str(e).splitlines()[0],
                )
        groups = self.cluster.groups
        if groups and groups[0] is self:  # the pods go, and every group on them
            for other in groups[1:]:
                other._remote = None
            groups.clear()
        elif self in groups:
            groups.remove(self)
        self._remote.teardown()
        self._remote = None
        return success


# NeMo's own names
RayVirtualCluster = VirtualCluster
RayWorkerGroup = WorkerGroup
RayWorkerBuilder = WorkerBuilder

__all__ = [
    "BatchedDataDict",
    "MultiWorkerFuture",
    "NamedSharding",
    "RayVirtualCluster",
    "RayWorkerBuilder",
    "RayWorkerGroup",
    "SlicedDataDict",
    "VirtualCluster",
    "WorkerBuilder",
    "WorkerFailureError",
    "WorkerGroup",
]
