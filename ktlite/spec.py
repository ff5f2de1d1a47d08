"""The frozen description of a deployment, and the distributed-env contract.

``distributed_env`` is the single place where RANK / WORLD_SIZE / MASTER_ADDR / ... are
computed: every backend and the pod server use it, so ranks mean the same everywhere.
"""

from __future__ import annotations

import json
import math
import re
import socket
from dataclasses import dataclass
from typing import Any

from ktlite.errors import ConfigError

FRAMEWORKS = ("spmd", "pytorch", "jax", "tensorflow", "ray", "monarch")
# frameworks whose pods run the engine's own runtime, formed by the pod servers: the call runs
# on pod 0 (the head, or Monarch's controller) only and returns one value
ENGINES = ("ray", "monarch")
DEFAULT_MASTER_PORT = 29500
# MASTER_PORT .. +31: the process groups' ports (a new group takes the next free one)
GROUP_PORTS = 32
# pod k's Ray node's ports, from MASTER_PORT + GROUP_PORTS + RAY_STRIDE × k: the named ones
# first, then the range its worker processes listen on. Every node has its own, so nodes
# never collide where pods share a host or a network (the local backend, the stand-in cluster)
RAY_STRIDE = 64
RAY_PORTS = {"gcs": 0, "node_manager": 1, "object_manager": 2, "runtime_env_agent": 3,
             "dashboard_agent_grpc": 4, "dashboard_agent_listen": 5, "metrics_export": 6,
             "client_server": 7, "dashboard": 8}
RAY_WORKER_PORTS = (16, RAY_STRIDE - 1)
# pod k's Monarch worker loop listens on MASTER_PORT + GROUP_PORTS + k (the procs it spawns
# pick their own ports)
# the env names ktlite sets on every pod or rank: a user's env or secret may not set them
RESERVED_ENV = (
    "KTLITE_TOKEN", "KTLITE_POD_NAME", "KTLITE_POD_IP", "KTLITE_POD_ORDINAL", "KTLITE_NAMESPACE",
    "KTLITE_DEPLOYMENT", "KTLITE_BACKEND", "KTLITE_PORT", "KTLITE_PROCS", "KTLITE_INSTALL",
    "KTLITE_FREEZE", "KTLITE_SETUP", "KTLITE_IMAGE",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "POD_IPS", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$")


@dataclass(frozen=True)
class DistributedConfig:
    """How many pods, processes per pod, and which framework's env each rank gets.

    Args:
        framework: ``"spmd"`` (default), ``"pytorch"``, ``"jax"``, ``"tensorflow"``,
            ``"ray"`` (pod 0 is a Ray head, the others its worker nodes; the call runs on the
            head only) or ``"monarch"`` (every pod runs Monarch's worker loop; the call runs on
            pod 0, Monarch's controller, which spawns procs on every pod).
        workers: number of pods (N; for Ray, ``Compute.distribute`` adds the head to the
            worker nodes asked for).
        num_proc: rank processes per pod (P), or one entry per pod for pods of different
            sizes (``[4, 8, 2]``: 14 ranks; pod k's ranks follow pod k-1's). World size is the
            sum. For Monarch, the procs per host that ``ktlite.distributed.monarch_procs()``
            spawns (kept in ``procs_per_host``; the controller is one rank process).
        procs_per_host: Monarch's procs per pod (set from ``num_proc``; other frameworks:
            None).
        port: MASTER_PORT; default 29500 on clusters, a free port on the local backend.
        quorum_timeout: seconds to wait for every worker to be reachable before a call.
    """

    framework: str = "spmd"
    workers: int = 1
    num_proc: int | tuple[int, ...] = 1
    port: int | None = None
    quorum_timeout: float = 300.0
    procs_per_host: int | None = None

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ConfigError(f"distribute(framework={self.framework!r}) is not a known framework; "
                              f"allowed: {', '.join(map(repr, FRAMEWORKS))}")
        _check_int("workers", self.workers, minimum=1,
                   fix="workers is the number of pods; use workers=1 for a single pod")
        if isinstance(self.num_proc, (list, tuple)):
            sizes = tuple(self.num_proc)
            if not sizes:
                raise ConfigError("num_proc=[] names no pod; give one rank count per pod, e.g. [4, 8, 2]")
            for i, n in enumerate(sizes):
                _check_int(f"num_proc[{i}]", n, minimum=1, fix="each entry is the rank processes of one pod")
            if len(sizes) != self.workers:
                raise ConfigError(f"num_proc={list(sizes)} names {len(sizes)} pod(s) but workers={self.workers}; "
                                  "leave workers out (it is then the list's length) or make them agree")
            # the same size everywhere is the plain form: one spelling per layout
            object.__setattr__(self, "num_proc", sizes[0] if len(set(sizes)) == 1 else sizes)
        else:
            _check_int("num_proc", self.num_proc, minimum=1,
                       fix="num_proc is the number of rank processes per pod")
        if self.framework == "monarch":
            self._monarch_procs()
        elif self.procs_per_host is not None:
            raise ConfigError(f"procs_per_host={self.procs_per_host!r} is Monarch's procs per pod; "
                              f"distribute({self.framework!r}) runs num_proc rank processes per pod")
        if self.engine and self.num_proc != 1:
            raise ConfigError(f"distribute({self.framework!r}, num_proc={self.num_proc}): a Ray node is one "
                              "process tree per pod that schedules its own workers; num_proc has no "
                              "meaning there. Leave it out, and size the nodes with cpus/gpus "
                              "(worker_node_options for the worker pods)")
        if self.port is not None:
            _check_int("port", self.port, minimum=1, maximum=65535, fix="pick a free TCP port such as 29500")
        if isinstance(self.quorum_timeout, bool) or not isinstance(self.quorum_timeout, (int, float)) \
                or not math.isfinite(self.quorum_timeout) or self.quorum_timeout <= 0:
            raise ConfigError(f"quorum_timeout={self.quorum_timeout!r} must be a positive number of seconds")

    def _monarch_procs(self) -> None:
        """Monarch's controller is one rank process on pod 0; ``num_proc`` is the procs it
        spawns on each host (Monarch's ``per_host``), kept in ``procs_per_host``."""
        if not isinstance(self.num_proc, int):
            raise ConfigError(f"distribute('monarch', num_proc={list(self.num_proc)}): Monarch spawns the "
                              "same procs on every host (spawn_procs(per_host=...)); give one number")
        if self.procs_per_host is None:
            object.__setattr__(self, "procs_per_host", self.num_proc)
            object.__setattr__(self, "num_proc", 1)
        elif self.num_proc != 1:
            raise ConfigError(f"distribute('monarch', num_proc={self.num_proc}, procs_per_host="
                              f"{self.procs_per_host}): give the procs per host once")
        _check_int("num_proc", self.procs_per_host, minimum=1,
                   fix="for Monarch it is the procs each host spawns (per_host={'gpus': num_proc})")

    @property
    def engine(self) -> bool:
        """Pods run an engine's own runtime (Ray, Monarch); calls go to pod 0 only."""
        return self.framework in ENGINES

    @property
    def port_span(self) -> int:
        """Ports from MASTER_PORT this deployment may use on one host: the process groups'
        (and TF_CONFIG's one per rank), every Ray node's, or every Monarch worker loop's."""
        if self.framework == "ray":
            return GROUP_PORTS + RAY_STRIDE * self.workers
        if self.framework == "monarch":
            return GROUP_PORTS + self.workers
        return max(GROUP_PORTS, self.world_size)

    @property
    def uniform(self) -> bool:
        return isinstance(self.num_proc, int)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Ranks of each pod."""
        return (self.num_proc,) * self.workers if isinstance(self.num_proc, int) else tuple(self.num_proc)

    @property
    def max_procs(self) -> int:
        return max(self.sizes)

    def procs(self, ordinal: int) -> int:
        """Ranks of pod ``ordinal``."""
        return self.num_proc if isinstance(self.num_proc, int) else self.num_proc[ordinal]

    def first_rank(self, ordinal: int) -> int:
        """The global rank of pod ``ordinal``'s LOCAL_RANK 0."""
        return ordinal * self.num_proc if isinstance(self.num_proc, int) else sum(self.num_proc[:ordinal])

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


def ray_ports(master_port: int, ordinal: int) -> dict[str, Any]:
    """The ports of pod ``ordinal``'s Ray node (named as in :data:`RAY_PORTS`, plus
    ``min_worker``/``max_worker``)."""
    base = master_port + GROUP_PORTS + RAY_STRIDE * ordinal
    ports: dict[str, Any] = {name: base + offset for name, offset in RAY_PORTS.items()}
    ports["min_worker"], ports["max_worker"] = base + RAY_WORKER_PORTS[0], base + RAY_WORKER_PORTS[1]
    if ports["max_worker"] > 65535:
        raise ConfigError(f"distribute(port={master_port}) leaves no room for the Ray nodes' ports "
                          f"(up to {ports['max_worker']}); pick a port below "
                          f"{65535 - GROUP_PORTS - RAY_STRIDE * (ordinal + 1)}")
    return ports


def monarch_port(master_port: int, ordinal: int) -> int:
    """The port of pod ``ordinal``'s Monarch worker loop."""
    port = master_port + GROUP_PORTS + ordinal
    if port > 65535:
        raise ConfigError(f"distribute(port={master_port}) leaves no room for the Monarch worker loops' "
                          f"ports (up to {port}); pick a port below {65535 - GROUP_PORTS - ordinal}")
    return port


def port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on every address of this host now (a
    MASTER_PORT for a new rendezvous)."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an integer; {fix}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ConfigError(f"{name}={value!r} is out of range; allowed: {allowed}; {fix}")


def check_name(name: str) -> str:
    """A deployment name as a DNS-1123 label (it names pods and Kubernetes objects).

    Like Kubetorch, a name is normalised: ``"GNN_Inference"`` becomes ``"gnn-inference"``
    (lowercase; every run of other characters one '-'). Only a name that normalises to
    nothing, or to more than 52 characters, is refused."""
    if not isinstance(name, str):
        raise ConfigError(f"name={name!r} must be a string such as 'train', not {type(name).__name__}")
    if _NAME_RE.match(name):
        return name
    normal = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not normal or len(normal) > 52 or not _NAME_RE.match(normal):
        suggestion = normal[:52].strip("-") or "my-fn"
        raise ConfigError(f"name={name!r} is not a valid deployment name: use lowercase letters, "
                          f"digits and '-', at most 52 characters, e.g. {suggestion!r}")
    return normal


def default_name(obj_name: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", obj_name.lower()).strip("-")[:52].strip("-")
    return name or "fn"


def distributed_env(config: DistributedConfig, *, node_rank: int, local_rank: int,
                    pod_ips: list[str], master_port: int, run_id: str = "ktlite",
                    cpus_per_pod: float | None = None) -> dict[str, str]:
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
        env.update(JAX_COORDINATOR_ADDRESS=f"{master}:{master_port}",
                   JAX_NUM_PROCESSES=str(world), JAX_PROCESS_ID=str(rank))
    elif config.framework == "tensorflow":
        # rank r listens on master_port + r: unique even when pods share a host (local backend)
        workers = [f"{pod_ips[config.ordinal_of(r)]}:{master_port + r}" for r in range(world)]
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                       "task": {"type": "worker", "index": rank}})
    if nproc > 1:
        cpus = cpus_per_pod or 1
        env["OMP_NUM_THREADS"] = str(max(1, int(cpus // nproc)))
    return env
