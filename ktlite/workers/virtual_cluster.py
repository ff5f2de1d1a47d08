"""``VirtualCluster``: NeMo RL's ``RayVirtualCluster`` as ktlite pods.

One entry of ``bundle_ct_per_node_list`` is one pod with that many ranks (NeMo's bundles).
Nothing starts until the first worker group is made on it (``ktlite.groups``); that group
deploys the pods, later groups are colocated in the same rank processes.

Addresses and free ports (NeMo's ``get_master_address_and_port`` and its siblings) are
asked of the pods themselves: a small function colocated in the first group's processes
binds free ports in ``[port_range_low, port_range_high)`` on the rank's own pod and returns
them with the pod's address.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

from ktlite.api.compute import Compute, parse_memory
from ktlite.errors import ConfigError

# NeMo's default master-port range: below the usual ephemeral range (32768-60999)
DEFAULT_PORT_RANGE_LOW = 1400
DEFAULT_PORT_RANGE_HIGH = 2000

# NeMo options whose job ktlite does differently: refused with the alternative, never ignored
_CLUSTER_REFUSED = {
    "gpu_ids": "ktlite gives each rank its own GPU (CUDA_VISIBLE_DEVICES per rank); pick GPUs with "
    "Compute(gpus=..., gpu_type=...) instead",
    "placement_group_strategy": "pods are ktlite's placement unit: one entry of the list per pod",
}
_CLUSTER_OPTIONS = (
    "bundle_ct_per_node_list",
    "use_gpus",
    "max_colocated_worker_groups",
    "enable_colocation",
    "communication_backend",
    "name",
    "compute",
    "num_gpus_per_node",
    "cpus",
    "memory",
    "image",
    "backend",
    "env_vars",
    "monitor_memory",
    "port_range_low",
    "port_range_high",
    "segment_size",
    "node_resource_constraints",
)


def refuse_options(
    what: str, given: dict[str, Any], refused: dict[str, str], allowed: Sequence[str]
) -> None:
    """A ConfigError for an option ktlite does another way (naming that way) or does not know."""
    for key in given:
        if key in refused:
            raise ConfigError(f"{what}({key}=...) is not supported by ktlite: {refused[key]}")
    if given:
        raise ConfigError(
            f"{what}() got unknown option(s) {', '.join(sorted(given))}; allowed: {', '.join(allowed)}"
        )


def _whole(value: Any, field: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{field}={value!r} must be a whole number >= {low}")
    return value


class VirtualCluster:
    """Pods sized per node, for one or more colocated :class:`WorkerGroup` s.

    Args:
        bundle_ct_per_node_list: ranks (workers) per pod, e.g. ``[4, 4]`` or ``[4, 8, 2]``.
        use_gpus: give each rank one GPU (each pod asks for as many GPUs as it has ranks).
            NeMo's default is True; ktlite's is False (CPU), so pass it as NeMo's code does.
        max_colocated_worker_groups: how many worker groups may share these pods' ranks
            (NeMo's ``enable_colocation=True`` means 2).
        communication_backend: recorded for the workers' own ``init_process_group``
            (``KTLITE_COMM_BACKEND`` in their environment): "gloo" or "nccl".
        name: the deployment's name (default: the first worker class's name).
        compute: a :class:`kt.Compute` with the pod settings (cpus, memory, image, backend,
            ...); its ``distribute`` is set from the list.
        num_gpus_per_node, cpus, memory, image, backend, env_vars: shortcuts for the
            corresponding Compute fields.
        port_range_low, port_range_high: where :meth:`get_master_address_and_port` and
            :meth:`get_available_address_and_port` pick ports (``[low, high)``, NeMo's default
            1400-1999).
        segment_size, node_resource_constraints: NeMo's NVLink-topology placement; only None
            (the default) is accepted.
    """

    def __init__(
        self,
        bundle_ct_per_node_list: Sequence[int],
        *,
        use_gpus: bool = False,
        max_colocated_worker_groups: int = 1,
        enable_colocation: bool | None = None,
        communication_backend: str = "gloo",
        name: str | None = None,
        compute: Compute | None = None,
        num_gpus_per_node: int | None = None,
        cpus: float | str | None = None,
        memory: str | None = None,
        image: Any = None,
        backend: str | None = None,
        env_vars: dict[str, str] | None = None,
        monitor_memory: bool = True,
        port_range_low: int | None = None,
        port_range_high: int | None = None,
        segment_size: int | None = None,
        node_resource_constraints: list[dict[str, float]] | None = None,
        **unknown: Any,
    ) -> None:
        refuse_options("VirtualCluster", unknown, _CLUSTER_REFUSED, _CLUSTER_OPTIONS)
        sizes = list(bundle_ct_per_node_list)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ConfigError(
                f"VirtualCluster({bundle_ct_per_node_list!r}): give one whole number >= 1 per node, "
                "e.g. [4, 4]"
            )
        if communication_backend not in ("gloo", "nccl"):
            raise ConfigError(
                f"communication_backend={communication_backend!r}: use 'gloo' or 'nccl'"
            )
        for field, given in (
            ("segment_size", segment_size),
            ("node_resource_constraints", node_resource_constraints),
        ):
            if given is not None:
                raise ConfigError(
                    f"VirtualCluster({field}={given!r}): NVLink-topology placement is not ktlite's; "
                    "ranks follow the pods in list order. Leave it None, and place pods with "
                    "Compute(node_selector=...) or the cluster's own scheduling"
                )
        if enable_colocation is not None:
            max_colocated_worker_groups = max(
                max_colocated_worker_groups, 2 if enable_colocation else 1
            )
        _whole(max_colocated_worker_groups, "max_colocated_worker_groups", 1)
        low = _whole(
            DEFAULT_PORT_RANGE_LOW if port_range_low is None else port_range_low,
            "port_range_low",
            1,
        )
        high = _whole(
            DEFAULT_PORT_RANGE_HIGH if port_range_high is None else port_range_high,
            "port_range_high",
            2,
        )
        if not low < high <= 65536:
            raise ConfigError(
                f"port_range_low={low}, port_range_high={high}: the range [low, high) must hold at least "
                "one port, with high <= 65536"
            )
        base = compute if compute is not None else Compute()
        if not isinstance(base, Compute):
            raise ConfigError(f"compute= needs a kt.Compute, got {type(base).__name__}")
        changes: dict[str, Any] = {
            "env": {**base.env, **(env_vars or {}), "KTLITE_COMM_BACKEND": communication_backend}
        }
        if use_gpus or num_gpus_per_node is not None:
            changes["gpus"] = num_gpus_per_node if num_gpus_per_node is not None else max(sizes)
        for key, value in (
            ("cpus", cpus),
            ("memory", memory),
            ("image", image),
            ("backend", backend),
        ):
            if value is not None:
                changes[key] = value
        self.sizes = sizes
        self.name = name or None  # NeMo's default name is ""
        self.use_gpus = bool(use_gpus)
        self.num_gpus_per_node = changes.get("gpus", 0)
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.communication_backend = communication_backend
        self.monitor_memory = monitor_memory
        self.port_range_low, self.port_range_high = low, high
        self.compute = replace(base, **changes).distribute("pytorch", num_proc=sizes)
        self.groups: list[Any] = []  # the WorkerGroups on these pods, the deploying one first
        # NeMo's topology-sorted bundle order (set only for its unified placement group):
        # ktlite's ranks are always in pod order, which NeMo's policies read as None
        self._sorted_bundle_indices: list[int] | None = None
        self._allocated_master_ports: set[int] = set()
        self._ports: tuple[Any, Any] | None = None  # (host remote, colocated free_ports function)

    def __repr__(self) -> str:
        return (
            f"VirtualCluster({self.sizes}, groups={[g.name for g in self.groups]}, "
            f"max_colocated_worker_groups={self.max_colocated_worker_groups})"
        )

    def world_size(self) -> int:
        """The number of ranks (workers) over all pods."""
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

    def group_compute(
        self, env_vars: Any, memory_limit: Any, max_restarts: Any, concurrency: Any, restart: bool
    ) -> Compute:
        """The pods' Compute with the first worker group's options."""
        changes: dict[str, Any] = {}
        if env_vars:
            changes["env"] = {**self.compute.env, **env_vars}
        if memory_limit is not None:
            changes["memory_limit"] = str(
                parse_memory(memory_limit, "memory_limit") * max(self.sizes)
            )
        if max_restarts is not None:
            changes["max_restarts"] = max_restarts
        if concurrency is not None:
            changes["concurrency"] = concurrency
        if not restart:
            changes["max_restarts"] = 0
        return replace(self.compute, **changes) if changes else self.compute

    # ---- addresses and free ports on the pods --------------------------------------------

    def get_master_address_and_port(self) -> tuple[str, int]:
        """Pod 0's address and a port free there, never one this cluster handed out before
        (so two groups' process groups do not collide)."""
        addr, port = self._free_ports([0], exclude=self._allocated_master_ports)[0]
        self._allocated_master_ports.add(port)
        return addr, port

    def get_available_address_and_port(self, pg_idx: int, bundle_idx: int) -> tuple[str, int]:
        """The address of pod ``pg_idx`` and a port free there (found by its rank ``bundle_idx``)."""
        return self.get_available_addresses_and_ports_batch([(pg_idx, bundle_idx)])[0]

    def get_available_addresses_and_ports_batch(
        self, pg_bundle_pairs: Sequence[tuple[int, int]], batch_size: int = 256
    ) -> list[tuple[str, int]]:
        """:meth:`get_available_address_and_port` for each ``(pg_idx, bundle_idx)``, in order;
        ports on one pod are distinct. One call reaches every pod at once, so ``batch_size``
        (how many answers NeMo fetches from Ray at a time) changes nothing."""
        _whole(batch_size, "batch_size", 1)
        starts = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        ranks = []
        for pair in pg_bundle_pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ConfigError(
                    f"pg_bundle_pairs holds {pair!r}: give (pg_idx, bundle_idx) pairs"
                )
            pg, bundle = pair
            if isinstance(pg, bool) or not isinstance(pg, int) or not 0 <= pg < len(self.sizes):
                raise ConfigError(f"pg_idx={pg!r} must be between 0 and {len(self.sizes) - 1}")
            if (
                isinstance(bundle, bool)
                or not isinstance(bundle, int)
                or not 0 <= bundle < self.sizes[pg]
            ):
                raise ConfigError(
                    f"bundle_idx={bundle!r} must be between 0 and {self.sizes[pg] - 1} on pod {pg}"
                )
            ranks.append(starts[pg] + bundle)
        return self._free_ports(ranks, exclude=set())

    def _free_ports(self, ranks: list[int], exclude: set[int]) -> list[tuple[str, int]]:
        import ktlite as kt

        if not ranks:
            return []
        host = self._host()
        if host is None:
            raise ConfigError(
                f"{self!r} has no pods yet: ktlite starts them with the first worker group; make a "
                "RayWorkerGroup on this cluster before asking for addresses and ports"
            )
        if self._ports is None or self._ports[0] is not host:
            self._ports = (host, kt.fn(free_ports).to(host, name="ktlite-free-ports"))
        called = sorted(set(ranks))
        counts = [ranks.count(r) if r in called else 0 for r in range(self.world_size())]
        call = self._ports[1].options(ranks=called)
        got = call(kt.per_rank(counts), self.port_range_low, self.port_range_high, sorted(exclude))
        answers = dict(zip(called, got, strict=True))
        out, used = [], {r: 0 for r in called}
        for r in ranks:
            addr, ports = answers[r]
            out.append((addr, ports[used[r]]))
            used[r] += 1
        return out

    def _host(self) -> Any:
        live = [g for g in self.groups if g._remote is not None]
        return live[0]._remote if live else None

    def shutdown(self) -> bool:
        """Tear down every worker group and the pods."""
        for group in list(reversed(self.groups)):
            group.shutdown()
        self.groups.clear()
        self._ports = None
        return True


def free_ports(count: int, low: int, high: int, exclude: list[int]) -> tuple[str, list[int]]:
    """On a rank: this pod's address and ``count`` distinct ports in ``[low, high)`` that
    could be bound just now (not in ``exclude``)."""
    ips = [ip for ip in os.environ.get("POD_IPS", "").split(",") if ip]
    node = int(os.environ.get("NODE_RANK", "0"))
    addr = ips[node] if node < len(ips) else os.environ.get("MASTER_ADDR", "127.0.0.1")
    skip = set(exclude)
    candidates = [p for p in range(low, high) if p not in skip]
    random.shuffle(candidates)
    found: list[int] = []
    with ExitStack() as held:  # hold each port until all are found, so they differ
        for port in candidates:
            if len(found) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("", port))
            except OSError:
                sock.close()
                continue
            held.callback(sock.close)
            found.append(port)
    if len(found) < count:
        raise RuntimeError(
            f"only {len(found)} of {count} port(s) in [{low}, {high}) are free on {addr} (excluded: "
            f"{len(exclude)}); widen VirtualCluster(port_range_low=..., port_range_high=...)"
        )
    return addr, found
