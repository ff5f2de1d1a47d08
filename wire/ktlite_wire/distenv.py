"""The distributed env contract: which RANK / WORLD_SIZE / MASTER_ADDR / ... each rank gets.

``distributed_env`` is the single place these are computed: the client (a backend's plan),
the pod server and every backend use it, so ranks mean the same everywhere. A
:class:`DistributedLayout` is the layout as the wire carries it; the client's
``ktlite.specs.spec.DistributedConfig`` is the same layout, validated for users.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

FRAMEWORKS = ("spmd", "pytorch", "jax", "tensorflow", "ray", "monarch")
# frameworks whose pods run the engine's own runtime, formed by the pod servers: the call runs
# on pod 0 (the head, or Monarch's controller) only and returns one value
ENGINES = ("ray", "monarch")
# MASTER_PORT .. +31: the process groups' ports (a new group takes the next free one)
GROUP_PORTS = 32


@dataclass(frozen=True)
class DistributedLayout:
    """How many pods, rank processes per pod (one number, or one per pod), and which
    framework's env each rank gets. Built from JSON, it checks only that the layout is
    consistent (``ValueError``); the client's ``DistributedConfig`` explains mistakes."""

    framework: str = "spmd"
    workers: int = 1
    num_proc: int | tuple[int, ...] = 1
    port: int | None = None
    quorum_timeout: float = 300.0
    procs_per_host: int | None = None
    # the call tree (ktlite_wire.calltree): children per pod, and the pods from which it is
    # used; None: the client's defaults
    tree_fanout: int | None = None
    tree_minimum: int | None = None

    def __post_init__(self) -> None:
        for key in ("tree_fanout", "tree_minimum"):
            value = getattr(self, key)
            if value is not None and not _count(value):
                raise ValueError(f"{key}={value!r} must be a whole number of at least 1")
        if isinstance(self.num_proc, list):
            object.__setattr__(self, "num_proc", tuple(self.num_proc))
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"framework {self.framework!r} is not one of {', '.join(FRAMEWORKS)}")
        sizes = (self.num_proc,) if isinstance(self.num_proc, int) else self.num_proc
        if not _count(self.workers) or not sizes or not all(_count(n) for n in sizes):
            raise ValueError(
                f"workers={self.workers!r} and num_proc={self.num_proc!r} must be whole "
                "numbers of at least 1"
            )
        if not isinstance(self.num_proc, int) and len(self.num_proc) != self.workers:
            raise ValueError(f"num_proc names {len(self.num_proc)} pods for workers={self.workers}")

    @classmethod
    def from_json(cls, data: Any) -> DistributedLayout:
        if not isinstance(data, dict):
            raise ValueError("the distributed layout must be a JSON object")
        known = {
            "framework",
            "workers",
            "num_proc",
            "port",
            "quorum_timeout",
            "procs_per_host",
            "tree_fanout",
            "tree_minimum",
        }
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def engine(self) -> bool:
        """Pods run an engine's own runtime (Ray, Monarch); calls go to pod 0 only."""
        return self.framework in ENGINES

    @property
    def uniform(self) -> bool:
        return isinstance(self.num_proc, int)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Ranks of each pod."""
        return (
            (self.num_proc,) * self.workers
            if isinstance(self.num_proc, int)
            else tuple(self.num_proc)
        )

    @property
    def max_procs(self) -> int:
        return max(self.sizes)

    def procs(self, ordinal: int) -> int:
        """Ranks of pod ``ordinal``."""
        return self.num_proc if isinstance(self.num_proc, int) else self.num_proc[ordinal]

    def first_rank(self, ordinal: int) -> int:
        """The global rank of pod ``ordinal``'s LOCAL_RANK 0."""
        return (
            ordinal * self.num_proc
            if isinstance(self.num_proc, int)
            else sum(self.num_proc[:ordinal])
        )

    def ordinal_of(self, rank: int) -> int:
        """The pod that holds global rank ``rank``."""
        if isinstance(self.num_proc, int):
            return rank // self.num_proc
        start = 0
        for ordinal, n in enumerate(self.num_proc):
            if rank < start + n:
                return ordinal
            start += n
        raise ValueError(f"rank {rank} is outside the world of {start} ranks")

    @property
    def world_size(self) -> int:
        return sum(self.sizes)


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on every address of this host now (a
    MASTER_PORT for a new rendezvous)."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def distributed_env(
    config: DistributedLayout,
    *,
    node_rank: int,
    local_rank: int,
    pod_ips: list[str],
    master_port: int,
    run_id: str = "ktlite",
    cpus_per_pod: float | None = None,
) -> dict[str, str]:
    """The env vars one rank gets. Stable: RANK = the ranks of the pods before this one
    (NODE_RANK × num_proc when every pod has num_proc) + LOCAL_RANK."""
    if len(pod_ips) != config.workers:
        raise ValueError(f"{len(pod_ips)} pod addresses for {config.workers} workers")
    nproc = config.procs(node_rank)
    if not 0 <= local_rank < nproc:
        raise ValueError(f"local rank {local_rank} is outside pod {node_rank}'s {nproc} rank(s)")
    rank = config.first_rank(node_rank) + local_rank
    world = config.world_size
    master = pod_ips[0]
    env = {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(config.workers),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "POD_IPS": ",".join(pod_ips),
        "KTLITE_FRAMEWORK": config.framework,
    }
    if config.framework == "pytorch":
        env["TORCHELASTIC_RUN_ID"] = run_id
    elif config.framework == "jax":
        env.update(
            JAX_COORDINATOR_ADDRESS=f"{master}:{master_port}",
            JAX_NUM_PROCESSES=str(world),
            JAX_PROCESS_ID=str(rank),
        )
    elif config.framework == "tensorflow":
        # rank r listens on master_port + r: unique even when pods share a host (local backend)
        workers = [f"{pod_ips[config.ordinal_of(r)]}:{master_port + r}" for r in range(world)]
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
        )
    if nproc > 1:
        cpus = cpus_per_pod or 1
        env["OMP_NUM_THREADS"] = str(max(1, int(cpus // nproc)))
    return env
