"""NeMo RL's worker-group API over ktlite: ``VirtualCluster`` and ``WorkerGroup``.

A thin face for code written against NeMo RL's ``RayVirtualCluster``/``RayWorkerGroup``:
change the import and it runs on ktlite's pods (local processes or Kubernetes), no Ray.
Each method is a few lines over ktlite's own calls, which say more about the behaviour:

==================================  ==============================================
NeMo                                 ktlite
==================================  ==============================================
``VirtualCluster([4, 8, 2])``        ``Compute(...).distribute("pytorch", num_proc=[4, 8, 2])``
``WorkerGroup(cluster, Worker)``     ``kt.cls(Worker).to(compute, init_args=...)``
second group on the same cluster     ``kt.cls(Gen).to(first_group_remote)`` (colocation)
``run_all_workers_single_data``      ``remote.method(*args, **kwargs)``
``run_all_workers_multiple_data``    ``remote.method(kt.per_rank(items), ...)``
``run_all_workers_sharded_data``     ``remote.method.sharded(data, layout=..., ...)``
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
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ktlite.compute import Compute, parse_memory
from ktlite.errors import ConfigError, RemoteError
from ktlite.spec import default_name

WorkerFailureError = RemoteError  # what a call raises when a worker failed or died

# NeMo options whose job ktlite does differently: refused with the alternative, never ignored
_CLUSTER_REFUSED = {
    "gpu_ids": "ktlite gives each rank its own GPU (CUDA_VISIBLE_DEVICES per rank); pick GPUs with "
               "Compute(gpus=..., gpu_type=...) instead",
    "placement_group_strategy": "pods are ktlite's placement unit: one entry of the list per pod",
}
_GROUP_REFUSED = {
    "enable_gradient_compression": "compress gradients in your own training code (e.g. a DDP comm hook)",
    "async_communication": "use run_all_workers_single_data(..., _async=True) futures instead",
    "enable_load_balancing": "a worker group calls every worker; for load-balanced serving use a "
                             "single-rank kt.cls with Compute(concurrency=K)",
    "load_balancing_strategy": "a worker group calls every worker",
    "bundle_indices_list": "a worker group spans every rank of its cluster",
    "workers_per_node": "set the ranks per pod in VirtualCluster([...])",
}


def _refuse(what: str, given: dict[str, Any], refused: dict[str, str], allowed: Sequence[str]) -> None:
    for key in given:
        if key in refused:
            raise ConfigError(f"{what}({key}=...) is not supported by ktlite: {refused[key]}")
    if given:
        raise ConfigError(f"{what}() got unknown option(s) {', '.join(sorted(given))}; "
                          f"allowed: {', '.join(allowed)}")


class VirtualCluster:
    """Pods sized per node, for one or more colocated :class:`WorkerGroup` s.

    Args:
        bundle_ct_per_node_list: ranks (workers) per pod, e.g. ``[4, 4]`` or ``[4, 8, 2]``.
        use_gpus: give each rank one GPU (each pod asks for as many GPUs as it has ranks).
        max_colocated_worker_groups: how many worker groups may share these pods' ranks
            (NeMo's ``enable_colocation=True`` means 2).
        communication_backend: recorded for the workers' own ``init_process_group``
            (``KTLITE_COMM_BACKEND`` in their environment): "gloo" or "nccl".
        name: the deployment's name (default: the first worker class's name).
        compute: a :class:`kt.Compute` with the pod settings (cpus, memory, image, backend,
            ...); its ``distribute`` is set from the list.
        num_gpus_per_node, cpus, memory, image, backend, env_vars: shortcuts for the
            corresponding Compute fields.

    Nothing starts until the first :class:`WorkerGroup` is made.
    """

    def __init__(self, bundle_ct_per_node_list: Sequence[int], *, use_gpus: bool = False,
                 max_colocated_worker_groups: int = 1, enable_colocation: bool | None = None,
                 communication_backend: str = "gloo", name: str | None = None,
                 compute: Compute | None = None, num_gpus_per_node: int | None = None,
                 cpus: float | str | None = None, memory: str | None = None, image: Any = None,
                 backend: str | None = None, env_vars: dict[str, str] | None = None,
                 monitor_memory: bool = True, **unknown: Any) -> None:
        _refuse("VirtualCluster", unknown, _CLUSTER_REFUSED,
                ("bundle_ct_per_node_list", "use_gpus", "max_colocated_worker_groups", "enable_colocation",
                 "communication_backend", "name", "compute", "num_gpus_per_node", "cpus", "memory",
                 "image", "backend", "env_vars", "monitor_memory"))
        sizes = list(bundle_ct_per_node_list)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ConfigError(f"VirtualCluster({bundle_ct_per_node_list!r}): give one whole number >= 1 "
                              "per node, e.g. [4, 4]")
        if communication_backend not in ("gloo", "nccl"):
            raise ConfigError(f"communication_backend={communication_backend!r}: use 'gloo' or 'nccl'")
        if enable_colocation is not None:
            max_colocated_worker_groups = max(max_colocated_worker_groups, 2 if enable_colocation else 1)
        if isinstance(max_colocated_worker_groups, bool) or not isinstance(max_colocated_worker_groups, int) \
                or max_colocated_worker_groups < 1:
            raise ConfigError(f"max_colocated_worker_groups={max_colocated_worker_groups!r} must be >= 1")
        base = compute if compute is not None else Compute()
        if not isinstance(base, Compute):
            raise ConfigError(f"compute= needs a kt.Compute, got {type(base).__name__}")
        changes: dict[str, Any] = {"env": {**base.env, **(env_vars or {}),
                                           "KTLITE_COMM_BACKEND": communication_backend}}
        if use_gpus or num_gpus_per_node is not None:
            changes["gpus"] = num_gpus_per_node if num_gpus_per_node is not None else max(sizes)
        for key, value in (("cpus", cpus), ("memory", memory), ("image", image), ("backend", backend)):
            if value is not None:
                changes[key] = value
        self.sizes = sizes
        self.name = name
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.communication_backend = communication_backend
        self.monitor_memory = monitor_memory
        self.compute = replace(base, **changes).distribute("pytorch", num_proc=sizes)
        self.groups: list[WorkerGroup] = []

    def __repr__(self) -> str:
        return (f"VirtualCluster({self.sizes}, groups={[g.name for g in self.groups]}, "
                f"max_colocated_worker_groups={self.max_colocated_worker_groups})")

    @property
    def world_size(self) -> int:
        return sum(self.sizes)

    def node_count(self) -> int:
        return len(self.sizes)

    def get_placement_groups(self) -> list[list[int]]:
        """The ranks of each pod (NeMo's placement groups): ``[[0, 1], [2, 3]]`` for ``[2, 2]``."""
        out, start = [], 0
        for size in self.sizes:
            out.append(list(range(start, start + size)))
            start += size
        return out

    def _host(self) -> Any:
        live = [g for g in self.groups if g._remote is not None]
        return live[0]._remote if live else None

    def shutdown(self) -> bool:
        """Tear down every worker group and the pods."""
        for group in reversed(self.groups):
            group.shutdown()
        self.groups.clear()
        return True


def _init_args(args: tuple[Any, ...], init_args: Any) -> Any:
    if args and init_args is not None:
        raise ConfigError("give the worker's constructor arguments either positionally or as init_args=, not both")
    return tuple(args) if args else init_args


class WorkerGroup:
    """One instance of ``worker_class`` per rank of ``cluster``, called all together.

    The first group on a cluster deploys its pods; later ones (up to
    ``max_colocated_worker_groups``) are colocated into the same rank processes: they share
    the pods, the GPUs, the process (so also its ``torch.distributed`` process group) and the
    order of calls (groups run in turn), not their instance state.

    Args:
        cluster: the :class:`VirtualCluster`.
        worker_class: the class to construct on every rank.
        *args, init_args: its constructor arguments (positional, or ``init_args=`` a dict/tuple).
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

    def __init__(self, cluster: VirtualCluster, worker_class: type, *args: Any, init_args: Any = None,
                 env_vars: dict[str, str] | None = None, name_prefix: str | None = None,
                 max_restarts: int | None = None, restart_on_failure: bool = True,
                 memory_limit: str | None = None, concurrency: int | None = None, **unknown: Any) -> None:
        import ktlite as kt

        _refuse("WorkerGroup", unknown, _GROUP_REFUSED,
                ("cluster", "worker_class", "init_args", "env_vars", "name_prefix", "max_restarts",
                 "restart_on_failure", "memory_limit", "concurrency"))
        if not isinstance(cluster, VirtualCluster):
            raise ConfigError(f"WorkerGroup needs a VirtualCluster, got {type(cluster).__name__}")
        if len(cluster.groups) >= cluster.max_colocated_worker_groups:
            raise ConfigError(
                f"{cluster!r} already holds {len(cluster.groups)} worker group(s), its maximum; make it with "
                f"max_colocated_worker_groups={len(cluster.groups) + 1} (or enable_colocation=True) to "
                "colocate another group on the same ranks, or use a second VirtualCluster for new pods")
        self.cluster = cluster
        self.worker_class = worker_class
        self.name = name_prefix or worker_class.__name__
        self.restart_on_failure = restart_on_failure
        init = _init_args(args, init_args)
        host = cluster._host()
        if host is not None:
            if env_vars or memory_limit or max_restarts is not None or concurrency is not None:
                raise ConfigError(f"WorkerGroup({self.name}) is colocated with {host.name!r}: it shares that "
                                  "group's processes, so env_vars, memory_limit, max_restarts and concurrency "
                                  "belong on the first group")
            self._remote = kt.cls(worker_class).to(host, init_args=init, name=default_name(self.name))
        else:
            compute = cluster.compute
            changes: dict[str, Any] = {}
            if env_vars:
                changes["env"] = {**compute.env, **env_vars}
            if memory_limit is not None:
                per = parse_memory(memory_limit, "memory_limit")
                changes["memory_limit"] = str(per * max(cluster.sizes))
            if max_restarts is not None:
                changes["max_restarts"] = max_restarts
            if concurrency is not None:
                changes["concurrency"] = concurrency
            if not restart_on_failure:
                changes["max_restarts"] = 0
            source = kt.cls(worker_class, name=cluster.name)
            self._remote = source.to(replace(compute, **changes) if changes else compute, init_args=init)
        cluster.groups.append(self)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name}, ranks={self.cluster.world_size}, cluster={self.cluster.sizes})"

    @property
    def remote(self) -> Any:
        """The ktlite :class:`RemoteClass` behind this group."""
        if self._remote is None:
            raise ConfigError(f"worker group {self.name!r} was shut down")
        return self._remote

    @property
    def workers(self) -> list[int]:
        return list(range(self.cluster.world_size))

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def _method(self, method_name: str) -> Any:
        if not isinstance(method_name, str):
            raise ConfigError(f"method_name={method_name!r} must be the name of a method of "
                              f"{self.worker_class.__name__}")
        return getattr(self.remote, method_name)

    def run_all_workers_single_data(self, method_name: str, *args: Any, _async: bool = False,
                                    **kwargs: Any) -> Any:
        """Call ``method_name(*args, **kwargs)`` on every worker: a list by rank (a future of it
        with ``_async=True``)."""
        method = self._method(method_name)
        return method.submit(*args, **kwargs) if _async else method(*args, **kwargs)

    def run_all_workers_multiple_data(self, method_name: str, *args: Any, common_kwargs: dict[str, Any] | None = None,
                                      _async: bool = False, **kwargs: Any) -> Any:
        """Each positional and keyword argument is a list with one item per worker; worker r
        gets item r of each (and only that item reaches its pod). ``common_kwargs`` go to
        every worker."""
        import ktlite as kt

        method = self._method(method_name)
        for key, value in list(enumerate(args)) + list(kwargs.items()):
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise ConfigError(f"run_all_workers_multiple_data: argument {key!r} must be a list with one item "
                                  f"per worker ({self.world_size}); pass shared values in common_kwargs=")
        shared = dict(common_kwargs or {})
        clash = sorted(set(shared) & set(kwargs))
        if clash:
            raise ConfigError(f"run_all_workers_multiple_data: {', '.join(clash)} given both per worker and in "
                              "common_kwargs")
        call_args = tuple(kt.per_rank(list(a)) for a in args)
        call_kwargs = {**{k: kt.per_rank(list(v)) for k, v in kwargs.items()}, **shared}
        return method.submit(*call_args, **call_kwargs) if _async else method(*call_args, **call_kwargs)

    def run_all_workers_sharded_data(self, method_name: str, data: Any, *, layout: dict[str, int],
                                     in_sharded_axes: Sequence[str] = (), replicate_on_axes: Sequence[str] = (),
                                     **kwargs: Any) -> Any:
        """NeMo's sharded dispatch: ``data`` (a list, one item per coordinate of the sharded
        axes) split along ``in_sharded_axes`` of ``layout`` and replicated along
        ``replicate_on_axes``; one result per coordinate of the sharded axes."""
        return self._method(method_name).sharded(data, *(), layout=layout, in_sharded_axes=in_sharded_axes,
                                                 replicate_on_axes=replicate_on_axes, **kwargs)

    def run_single_worker_single_data(self, method_name: str, worker_idx: int, *args: Any,
                                      _async: bool = False, **kwargs: Any) -> Any:
        """Call ``method_name`` on worker ``worker_idx`` only: its result (a future of it with
        ``_async=True``)."""
        if isinstance(worker_idx, bool) or not isinstance(worker_idx, int) or not 0 <= worker_idx < self.world_size:
            raise ConfigError(f"worker_idx={worker_idx!r} must be between 0 and {self.world_size - 1}")
        bound = self._method(method_name).options(ranks=[worker_idx])
        if _async:
            return _First(bound.submit(*args, **kwargs))
        return bound(*args, **kwargs)[0]

    def get_all_worker_results(self, futures: Any, timeout: float | None = None) -> list[Any]:
        """Wait for what the ``run_*`` methods returned with ``_async=True`` (a future, a list of
        futures, or results already in hand): the results in order."""
        if isinstance(futures, (concurrent.futures.Future, _First)):
            return futures.result(timeout)
        if isinstance(futures, (list, tuple)):
            return [f.result(timeout) if isinstance(f, (concurrent.futures.Future, _First)) else f for f in futures]
        return futures

    def restart_failed_workers(self) -> list[int]:
        """Restart the worker processes that died (only those: the others keep their state);
        the restarted ranks, in order."""
        return self.remote.restart_failed()["restarted"]

    def _ranks(self, stuck_after: float | None = None) -> list[dict[str, Any]]:
        rows = [{**r, "pod": pod["pod"]} for pod in self.remote.status(stuck_after) for r in pod.get("ranks", [])]
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
                "gpu_memory_total_bytes", "gpu_utilization_percent")
        return [{k: r.get(k) for k in keys} for r in self._ranks()]

    def shutdown(self, force: bool = False) -> bool:
        """Remove this group's workers (a colocated group leaves its host's pods running; the
        first group takes the pods and every group on them down)."""
        if self._remote is None:
            return True
        if self.cluster.groups and self.cluster.groups[0] is self:
            for other in self.cluster.groups[1:]:
                other._remote = None
        self._remote.teardown()
        self._remote = None
        return True


class _First:
    """A future of one worker's result over a future of the list ktlite returns."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> Any:
        return self._future.result(timeout)[0]

    def done(self) -> bool:
        return self._future.done()

    def __await__(self) -> Any:
        return (yield from _await_first(self._future).__await__())


async def _await_first(future: Any) -> Any:
    return (await future)[0]


# NeMo's own names
RayVirtualCluster = VirtualCluster
RayWorkerGroup = WorkerGroup

__all__ = ["RayVirtualCluster", "RayWorkerGroup", "VirtualCluster", "WorkerFailureError", "WorkerGroup"]
