"""The checks of ``kt.Compute``'s fields that look past one value: the environment, the volumes
and their mount paths, the SSH hosts, a Ray cluster's worker-node options, the rank layout
against the GPUs and serving, and the "did you mean" of a keyword Compute does not take.

Each check names the field, the bad value, what is allowed and the fix. A field's own type and
range are checked by the part that holds it (:mod:`ktlite.specs.call_defaults`,
:mod:`ktlite.specs.kube_options`, :mod:`ktlite.specs.podspec`, ...).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

from ktlite.backends.registry import HOSTS_BACKEND, NAMES, traits
from ktlite.config import get as setting
from ktlite.errors import ConfigError
from ktlite.specs.hosts import Host, Hosts, as_hosts
from ktlite.specs.serving_options import ServingOptions
from ktlite.specs.spec import RESERVED_ENV, DistributedConfig
from ktlite.specs.volume import DNS_LABEL, Volume

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")  # what Kubernetes accepts (and POSIX shells)
RESERVED_MOUNTS = ("/ktlite", "/dev/shm")  # ktlite's state dir and shared memory on a pod
# what distribute("ray", worker_node_options={...}) may size differently on the worker pods
WORKER_NODE_FIELDS = (
    "cpus",
    "memory",
    "gpus",
    "cpu_limit",
    "memory_limit",
    "gpu_type",
    "shared_memory",
    "node_selector",
    "tolerations",
    "labels",
    "annotations",
    "priority_class",
)


def unknown_keywords(kwargs: Iterable[str], known: Iterable[str]) -> ConfigError:
    """The error for keywords Compute does not take, with the closest ``known`` names."""
    names = sorted(set(known))
    hints = []
    for name in sorted(kwargs):
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hints.append(f"{name!r} (did you mean {close[0]}?)" if close else repr(name))
    return ConfigError(
        f"Compute() got unknown keyword(s) {', '.join(hints)}; see help(kt.Compute) for "
        "the keywords it takes"
    )


def check_pod_settings(backend: object, freeze: object, working_dir: object) -> None:
    """The backend's name, ``freeze`` and the rank processes' working directory."""
    if backend is not None and backend not in NAMES:
        raise ConfigError(f"backend={backend!r}; allowed: {', '.join(map(repr, NAMES))}")
    if not isinstance(freeze, bool):
        raise ConfigError(f"freeze={freeze!r} must be True or False")
    if working_dir is not None and (
        not isinstance(working_dir, str) or not working_dir.startswith("/")
    ):
        raise ConfigError(
            f"working_dir={working_dir!r} must be an absolute path in the pod, e.g. '/workspace'"
        )


def check_tls(tls: object) -> None:
    if tls is not None and not isinstance(tls, bool):
        raise ConfigError(
            f"tls={tls!r} must be True, False or None (the backend's default: on for ssh and "
            "kubernetes, off for local)"
        )


def check_env(env: object) -> None:
    """Names a pod's environment can hold, values without NUL, none of the per-rank ones."""
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ConfigError(f"env={env!r} must map str to str; convert values with str()")
    bad = [k for k in env if not ENV_NAME.match(k)]
    if bad:
        raise ConfigError(
            f"env names {bad!r} are not valid environment variable names: use "
            "letters, digits and '_' (not starting with a digit), e.g. 'MY_VAR'"
        )
    nul = [k for k, v in env.items() if "\0" in v]
    if nul:
        raise ConfigError(
            f"env values of {nul!r} contain a NUL character, which no environment can hold"
        )
    clash = sorted(set(env) & set(RESERVED_ENV))
    if clash:
        raise ConfigError(
            f"env sets {', '.join(clash)}, which ktlite sets per rank; remove "
            "them (use distribute(port=...) for MASTER_PORT)"
        )


def check_volumes(volumes: Iterable[Any], namespace: str | None) -> tuple[Volume | str, ...]:
    """The volumes as a tuple: each a kt.Volume of the deployment's namespace or a PVC's name,
    each at a mount path of its own that ktlite does not use."""
    checked = tuple(volumes)
    mounts: dict[str, Any] = {}
    for v in checked:
        if not isinstance(v, (Volume, str)):
            raise ConfigError(
                f"volumes entry {v!r} must be a kt.Volume or the name of an existing PVC"
            )
        if isinstance(v, str) and not DNS_LABEL.match(v):
            raise ConfigError(
                f"volumes entry {v!r} is not a valid PVC name (lowercase letters, digits and '-')"
            )
        if isinstance(v, Volume) and v.namespace and namespace and v.namespace != namespace:
            raise ConfigError(
                f"Volume({v.name!r}, namespace={v.namespace!r}) is not in the deployment's "
                f"namespace {namespace!r}; pods mount claims of their own namespace"
            )
        path = v.mount_path if isinstance(v, Volume) else f"/{v}"
        if path.rstrip("/") in RESERVED_MOUNTS:
            raise ConfigError(
                f"volume {v!r} mounts at {path}, which ktlite uses on every pod; "
                "pass another mount_path"
            )
        if path in mounts:
            raise ConfigError(
                f"volumes {mounts[path]!r} and {v!r} both mount at {path}; give "
                "each its own mount_path"
            )
        mounts[path] = v
    return checked


def resolve_hosts(
    hosts: Any, backend: str | None, distributed: DistributedConfig | None, gpus: int
) -> tuple[Hosts | None, str | None, DistributedConfig | None]:
    """``hosts`` means the ssh backend, one pod per host, each host's ranks its own: the
    hosts (given, or `ktlite config set ssh.hosts gpu1,gpu2` for that backend), the backend and
    the rank layout they make."""
    found = as_hosts(hosts)
    if found is None and traits(backend).hosts:
        listed = [h.strip() for h in (setting("ssh.hosts") or "").split(",") if h.strip()]
        found = Hosts(tuple(Host(h) for h in listed)) if listed else None
    if found is None:
        return None, backend, distributed
    if backend is None:
        backend = HOSTS_BACKEND
    elif not traits(backend).hosts:
        raise ConfigError(
            f"hosts= names the machines of backend='ssh', not backend={backend!r}; "
            "leave backend out (or 'ssh') to run on those hosts"
        )
    d = distributed
    if d is None:
        sizes = tuple(n or gpus or 1 for n in found.sizes)
        return found, backend, DistributedConfig(workers=len(found), num_proc=sizes)
    if d.workers != len(found):
        raise ConfigError(
            f"distribute(workers={d.workers}) but hosts= names {len(found)} host(s); one pod "
            "runs per host: leave workers out, or list as many hosts"
        )
    clash = [
        (h.address, h.num_proc, d.procs(i))
        for i, h in enumerate(found.hosts)
        if h.num_proc is not None and h.num_proc != d.procs(i)
    ]
    if clash:
        address, own, given = clash[0]
        raise ConfigError(
            f"Host({address!r}, num_proc={own}) but distribute() gives it {given} rank(s); "
            "leave num_proc out of distribute() to use each host's own"
        )
    return found, backend, d


def check_worker_node_options(options: object, distributed: DistributedConfig | None) -> None:
    """``worker_node_options`` is a dict, and only a Ray cluster has worker nodes."""
    if not isinstance(options, dict):
        raise ConfigError(
            f"worker_node_options={options!r} must be a dict of Compute fields, e.g. "
            "{'cpus': '4', 'memory': '16Gi', 'gpus': 1}"
        )
    if distributed is None or distributed.framework != "ray":
        raise ConfigError(
            "worker_node_options sizes the worker nodes of a Ray cluster; it needs "
            "distribute('ray', ...). For pods of different sizes otherwise, "
            "use num_proc=[...] (one entry per pod)"
        )


def check_worker_node_fields(options: dict[str, Any]) -> None:
    """The fields a worker node may size apart from the head (the rest are the head's)."""
    unknown = sorted(set(options) - set(WORKER_NODE_FIELDS))
    if unknown:
        raise ConfigError(
            f"worker_node_options has unknown or head-only field(s) "
            f"{', '.join(map(repr, unknown))}; allowed: {', '.join(WORKER_NODE_FIELDS)} "
            "(image, env, volumes and the rest are the head's for every node)"
        )


def check_layout(distributed: DistributedConfig | None, gpus: int, serving: ServingOptions) -> None:
    """The rank layout against the GPUs (one per rank) and serving (replicas or autoscale)."""
    d = distributed
    if d is not None and d.uniform and gpus and d.max_procs > gpus:
        raise ConfigError(
            f"num_proc={d.num_proc} has a pod of {d.max_procs} ranks, more than gpus={gpus} "
            f"on a GPU pod; each rank needs at least one GPU: use num_proc<={gpus}"
        )
    if serving.autoscaling is not None and d is not None:
        raise ConfigError("a Compute cannot use both .distribute() and .autoscale(); pick one")
    replicas = serving.replicas
    if replicas is not None and d is not None and replicas != d.workers:
        raise ConfigError(
            f"replicas={replicas} but distribute() asks for {d.workers} pods; "
            "leave replicas out (distribute's workers sets it)"
        )
