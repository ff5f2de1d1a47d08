"""The frozen description of a deployment, and its distributed layout as users give it.

The env each rank gets is computed in one place, ``ktlite_wire.distenv.distributed_env``
(re-exported here): every backend and the pod server use it, so ranks mean the same
everywhere.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ktlite.errors import ConfigError
from ktlite_wire.distenv import (  # noqa: F401 - the env contract, re-exported for the client
    ENGINES,
    FRAMEWORKS,
    GROUP_PORTS,
    DistributedLayout,
    distributed_env,
    port_free,
)

DEFAULT_MASTER_PORT = 29500
# pod k's Ray node's ports, from MASTER_PORT + GROUP_PORTS + RAY_STRIDE × k: the named ones
# first, then the range its worker processes listen on. Every node has its own, so nodes
# never collide where pods share a host or a network (the local backend, the stand-in cluster)
RAY_STRIDE = 64
RAY_PORTS = {
    "gcs": 0,
    "node_manager": 1,
    "object_manager": 2,
    "runtime_env_agent": 3,
    "dashboard_agent_grpc": 4,
    "dashboard_agent_listen": 5,
    "metrics_export": 6,
    "client_server": 7,
    "dashboard": 8,
}
RAY_WORKER_PORTS = (16, RAY_STRIDE - 1)
# the env names ktlite sets on every pod or rank: a user's env or secret may not set them
RESERVED_ENV = (
    "KTLITE_TOKEN",
    "KTLITE_TOKEN_FILE",
    "KTLITE_SECRET_LINKS",
    "KTLITE_POD_NAME",
    "KTLITE_POD_IP",
    "KTLITE_POD_ORDINAL",
    "KTLITE_NAMESPACE",
    "KTLITE_DEPLOYMENT",
    "KTLITE_BACKEND",
    "KTLITE_PORT",
    "KTLITE_PROCS",
    "KTLITE_INSTALL",
    "KTLITE_FREEZE",
    "KTLITE_SETUP",
    "KTLITE_IMAGE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "POD_IPS",
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
)
# pod k's Monarch worker loop listens on MASTER_PORT + GROUP_PORTS + k (the procs it spawns
# pick their own ports)
# the call tree's defaults (distribute(tree_fanout=, tree_minimum=)), measured with
# bench/bench_scale.py (see bench/README.md, "Scale")
TREE_FANOUT = 32
TREE_MINIMUM = 64
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$")


@dataclass(frozen=True)
class DistributedConfig(DistributedLayout):
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
        tree_fanout: children per pod of the call tree (Kubetorch's keyword): from
            ``tree_minimum`` pods on, pod 0 sends a call, a code push and a cancel to at most
            this many pods, and each of them relays it to its own share of the rest. None:
            :data:`TREE_FANOUT`.
        tree_minimum: the pod count from which calls and code pushes go down the tree (below
            it pod 0 reaches every pod itself). None: :data:`TREE_MINIMUM`.
    """

    framework: str = "spmd"
    workers: int = 1
    num_proc: int | tuple[int, ...] = 1
    port: int | None = None
    quorum_timeout: float = 300.0
    procs_per_host: int | None = None
    tree_fanout: int | None = None
    tree_minimum: int | None = None

    def __post_init__(self) -> None:
        for key in ("tree_fanout", "tree_minimum"):
            if getattr(self, key) is not None:
                _check_int(
                    key, getattr(self, key), minimum=1, fix=f"leave {key} out for the default"
                )
        if self.framework not in FRAMEWORKS:
            raise ConfigError(
                f"distribute(framework={self.framework!r}) is not a known framework; "
                f"allowed: {', '.join(map(repr, FRAMEWORKS))}"
            )
        _check_int(
            "workers",
            self.workers,
            minimum=1,
            fix="workers is the number of pods; use workers=1 for a single pod",
        )
        if isinstance(self.num_proc, (list, tuple)):
            sizes = tuple(self.num_proc)
            if not sizes:
                raise ConfigError(
                    "num_proc=[] names no pod; give one rank count per pod, e.g. [4, 8, 2]"
                )
            for i, n in enumerate(sizes):
                _check_int(
                    f"num_proc[{i}]",
                    n,
                    minimum=1,
                    fix="each entry is the rank processes of one pod",
                )
            if len(sizes) != self.workers:
                raise ConfigError(
                    f"num_proc={list(sizes)} names {len(sizes)} pod(s) but workers={self.workers}; "
                    "leave workers out (it is then the list's length) or make them agree"
                )
            # the same size everywhere is the plain form: one spelling per layout
            object.__setattr__(self, "num_proc", sizes[0] if len(set(sizes)) == 1 else sizes)
        else:
            _check_int(
                "num_proc",
                self.num_proc,
                minimum=1,
                fix="num_proc is the number of rank processes per pod",
            )
        if self.framework == "monarch":
            self._monarch_procs()
        elif self.procs_per_host is not None:
            raise ConfigError(
                f"procs_per_host={self.procs_per_host!r} is Monarch's procs per pod; "
                f"distribute({self.framework!r}) runs num_proc rank processes per pod"
            )
        if self.engine and self.num_proc != 1:
            raise ConfigError(
                f"distribute({self.framework!r}, num_proc={self.num_proc}): a Ray node is one "
                "process tree per pod that schedules its own workers; num_proc has no "
                "meaning there. Leave it out, and size the nodes with cpus/gpus "
                "(worker_node_options for the worker pods)"
            )
        if self.port is not None:
            _check_int(
                "port",
                self.port,
                minimum=1,
                maximum=65535,
                fix="pick a free TCP port such as 29500",
            )
        if (
            isinstance(self.quorum_timeout, bool)
            or not isinstance(self.quorum_timeout, (int, float))
            or not math.isfinite(self.quorum_timeout)
            or self.quorum_timeout <= 0
        ):
            raise ConfigError(
                f"quorum_timeout={self.quorum_timeout!r} must be a positive number of seconds"
            )

    def _monarch_procs(self) -> None:
        """Monarch's controller is one rank process on pod 0; ``num_proc`` is the procs it
        spawns on each host (Monarch's ``per_host``), kept in ``procs_per_host``."""
        if not isinstance(self.num_proc, int):
            raise ConfigError(
                f"distribute('monarch', num_proc={list(self.num_proc)}): Monarch spawns the "
                "same procs on every host (spawn_procs(per_host=...)); give one number"
            )
        if self.procs_per_host is None:
            object.__setattr__(self, "procs_per_host", self.num_proc)
            object.__setattr__(self, "num_proc", 1)
        elif self.num_proc != 1:
            raise ConfigError(
                f"distribute('monarch', num_proc={self.num_proc}, procs_per_host="
                f"{self.procs_per_host}): give the procs per host once"
            )
        _check_int(
            "num_proc",
            self.procs_per_host,
            minimum=1,
            fix="for Monarch it is the procs each host spawns (per_host={'gpus': num_proc})",
        )

    def tree(self, pods: int) -> int:
        """The call tree's fan-out for a call or a code push to ``pods`` pods (0: flat)."""
        minimum = TREE_MINIMUM if self.tree_minimum is None else self.tree_minimum
        if pods < max(minimum, 2):
            return 0
        return TREE_FANOUT if self.tree_fanout is None else self.tree_fanout

    @property
    def port_span(self) -> int:
        """Ports from MASTER_PORT this deployment may use on one host: the process groups'
        (and TF_CONFIG's one per rank), every Ray node's, or every Monarch worker loop's."""
        if self.framework == "ray":
            return GROUP_PORTS + RAY_STRIDE * self.workers
        if self.framework == "monarch":
            return GROUP_PORTS + self.workers
        return max(GROUP_PORTS, self.world_size)


def ray_ports(master_port: int, ordinal: int) -> dict[str, Any]:
    """The ports of pod ``ordinal``'s Ray node (named as in :data:`RAY_PORTS`, plus
    ``min_worker``/``max_worker``)."""
    base = master_port + GROUP_PORTS + RAY_STRIDE * ordinal
    ports: dict[str, Any] = {name: base + offset for name, offset in RAY_PORTS.items()}
    ports["min_worker"], ports["max_worker"] = (
        base + RAY_WORKER_PORTS[0],
        base + RAY_WORKER_PORTS[1],
    )
    if ports["max_worker"] > 65535:
        raise ConfigError(
            f"distribute(port={master_port}) leaves no room for the Ray nodes' ports "
            f"(up to {ports['max_worker']}); pick a port below "
            f"{65535 - GROUP_PORTS - RAY_STRIDE * (ordinal + 1)}"
        )
    return ports


def monarch_port(master_port: int, ordinal: int) -> int:
    """The port of pod ``ordinal``'s Monarch worker loop."""
    port = master_port + GROUP_PORTS + ordinal
    if port > 65535:
        raise ConfigError(
            f"distribute(port={master_port}) leaves no room for the Monarch worker loops' "
            f"ports (up to {port}); pick a port below {65535 - GROUP_PORTS - ordinal}"
        )
    return port


def _check_int(
    name: str, value: Any, *, minimum: int, maximum: int | None = None, fix: str
) -> None:
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
        raise ConfigError(
            f"name={name!r} must be a string such as 'train', not {type(name).__name__}"
        )
    if _NAME_RE.match(name):
        return name
    normal = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not normal or len(normal) > 52 or not _NAME_RE.match(normal):
        suggestion = normal[:52].strip("-") or "my-fn"
        raise ConfigError(
            f"name={name!r} is not a valid deployment name: use lowercase letters, "
            f"digits and '-', at most 52 characters, e.g. {suggestion!r}"
        )
    return normal


def default_name(obj_name: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", obj_name.lower()).strip("-")[:52].strip("-")
    return name or "fn"
