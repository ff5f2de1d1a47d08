"""The rank layout ``Compute.distribute()`` asks for: its arguments, Kubetorch's spellings
among them, turned into the :class:`~ktlite.specs.spec.DistributedConfig` of ``workers`` pods
× ``num_proc`` ranks (or a Ray cluster's head and worker nodes)."""

from __future__ import annotations

from typing import Any, cast

from ktlite.errors import ConfigError
from ktlite.specs.hosts import Hosts
from ktlite.specs.spec import DistributedConfig

NumProc = int | list[int] | tuple[int, ...] | str | None

OPTIONS = (
    "framework (distribution_type), workers, num_proc, port, quorum_timeout, "
    "worker_node_options (framework='ray'), quorum_workers, monitor_members, "
    "max_threads_per_proc, restart_procs, tree_fanout, tree_minimum"
)


def framework_of(framework: str | None, distribution_type: str | None) -> str:
    """The framework, from ktlite's ``framework`` or Kubetorch's ``distribution_type``
    (default "spmd"; "tf" is "tensorflow")."""
    if distribution_type is not None:
        if framework is not None and framework != distribution_type:
            raise ConfigError(
                "pass framework= or distribution_type= (the Kubetorch name), not both"
            )
        framework = distribution_type
    framework = "spmd" if framework is None else framework
    return "tensorflow" if framework == "tf" else framework


def check_kubetorch_options(
    monitor_members: object, tree_fanout: object, tree_minimum: object
) -> None:
    """Kubetorch's keywords take only values it takes: ``monitor_members`` changes nothing
    (ktlite always watches the members); the tree's are the call tree's (DistributedConfig)."""
    if monitor_members is not None and not isinstance(monitor_members, bool):
        raise ConfigError(f"monitor_members={monitor_members!r} must be True or False")
    for key, value in (("tree_fanout", tree_fanout), ("tree_minimum", tree_minimum)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ConfigError(f"{key}={value!r} must be a whole number >= 1")


def check_quorum_workers(quorum_workers: object, pods: int) -> None:
    """Kubetorch's ``quorum_workers``: a call runs on every pod, so it can only be all of them."""
    if quorum_workers is not None and quorum_workers != pods:
        raise ConfigError(
            f"quorum_workers={quorum_workers!r}: ktlite runs a call on every pod, so it "
            f"waits for all {pods} (up to quorum_timeout) and fails naming the missing "
            "ones; leave quorum_workers out, or lower workers"
        )


def layout(
    framework: str,
    workers: int | None,
    num_proc: NumProc,
    port: int | None,
    quorum_timeout: float,
    worker_node_options: dict[str, Any] | None,
    *,
    gpus: int,
    hosts: Hosts | None,
    autoscaled: bool,
    unknown: dict[str, Any],
) -> tuple[DistributedConfig, dict[str, Any] | None]:
    """The layout of ``workers`` pods × ``num_proc`` ranks each, and a Ray cluster's
    worker-node options (None for any other framework).

    ``num_proc`` defaults to the pod's GPU count (one rank per GPU), else 1. A list gives
    each pod its own size (``num_proc=[4, 8, 2]``: 3 pods, 14 ranks); ``workers`` is then
    its length. ``workers`` defaults to 1 otherwise, or one pod per host of ``hosts``.

    ``framework="ray"``: a Ray cluster of one head pod (where the function runs) plus
    ``workers`` worker-node pods (default 1), sized with ``worker_node_options`` applied
    (``{"cpus": "4", "memory": "16Gi", "gpus": 1}``).
    """
    if autoscaled:
        raise ConfigError(
            "a Compute cannot use both .autoscale() and .distribute(): autoscale() sends "
            "each call to one of N interchangeable replicas, distribute() runs every call "
            "on every rank of N pods; pick one"
        )
    if unknown:
        raise ConfigError(
            f"distribute() got unknown option(s) {', '.join(sorted(unknown))}; allowed: {OPTIONS}"
        )
    if framework == "ray":
        return _ray(workers, num_proc, port, quorum_timeout, worker_node_options)
    if worker_node_options is not None:
        raise ConfigError(
            f"distribute({framework!r}, worker_node_options=...): only framework='ray' "
            "has worker nodes of their own size; for pods of different sizes use "
            "num_proc=[...] (one entry per pod)"
        )
    if hosts is not None:  # one pod per host, each with its own ranks unless given
        workers = len(hosts) if workers is None else workers
        if num_proc is None and any(n is not None for n in hosts.sizes):
            num_proc = [n or gpus or 1 for n in hosts.sizes]
    if num_proc is None:
        num_proc = gpus or 1
    if isinstance(num_proc, (list, tuple)) and not num_proc:
        raise ConfigError("num_proc=[] names no pod; give one rank count per pod, e.g. [4, 8, 2]")
    if workers is None:
        workers = len(num_proc) if isinstance(num_proc, (list, tuple)) else 1
    config = DistributedConfig(
        framework=framework,
        workers=workers,
        num_proc=_sizes(num_proc),
        port=port,
        quorum_timeout=quorum_timeout,
    )
    return config, None


def _ray(
    workers: int | None,
    num_proc: NumProc,
    port: int | None,
    quorum_timeout: float,
    worker_node_options: dict[str, Any] | None,
) -> tuple[DistributedConfig, dict[str, Any] | None]:
    """A Ray cluster: the head pod and ``workers`` worker nodes (default 1)."""
    if workers is None:
        workers = 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(
            f"distribute('ray', workers={workers!r}): workers is the number of Ray "
            "worker nodes besides the head (0 for a head alone)"
        )
    config = DistributedConfig(
        framework="ray",
        workers=workers + 1,
        num_proc=1 if num_proc is None else _sizes(num_proc),
        port=port,
        quorum_timeout=quorum_timeout,
    )
    if worker_node_options is not None and not isinstance(worker_node_options, dict):
        raise ConfigError(
            f"worker_node_options={worker_node_options!r} must be a dict of Compute "
            "fields, e.g. {'cpus': '4', 'memory': '16Gi', 'gpus': 1}"
        )
    return config, None if worker_node_options is None else dict(worker_node_options)


def _sizes(num_proc: int | list[int] | tuple[int, ...] | str) -> int | tuple[int, ...]:
    """``num_proc`` as DistributedConfig keeps it: a list as a tuple (its __post_init__ does the
    same). A str other than "auto" (gone by now) goes as it is, for DistributedConfig to refuse."""
    if isinstance(num_proc, list):
        return tuple(num_proc)
    return cast("int | tuple[int, ...]", num_proc)
