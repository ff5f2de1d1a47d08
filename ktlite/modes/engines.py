"""Engines the pods run for ``distribute("ray")`` and ``distribute("monarch")``: what the
client decides for each pod.

Ray: pod 0 is the head and runs the function; pods 1..N are worker nodes. Monarch: every pod
runs Monarch's worker loop (a host of the mesh); the function runs on pod 0, the controller.
The pod servers start the engines themselves (``ktlite_server.raynode``,
``ktlite_server.monarchhost``), by IP, on ports from the deployment's range
(``ktlite.specs.spec.ray_ports``, ``ktlite.specs.spec.monarch_port``); no operator, no DNS. This module
checks the caller's side before anything is deployed and builds each pod's engine settings.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import math
import os
from typing import Any

from ktlite.errors import ConfigError
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite.specs.spec import monarch_port, ray_ports

MIN_OBJECT_STORE = 80 * 2**20  # Ray refuses less than 75 MiB
LOCAL_OBJECT_STORE_MAX = (
    512 * 2**20
)  # per node when nodes share this machine, whatever `memory` says
HEAP_SHARE = 0.7  # of a pod's memory: the rest is its object store


def client_ray_version() -> str | None:
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_client(spec: DeploymentSpec) -> None:
    """Before anything is deployed: what the engine needs on this machine."""
    if spec.distributed.framework == "ray" and client_ray_version() is None:
        raise ConfigError(
            "distribute('ray') needs Ray on this machine too, at the version of the pods' "
            "image (it is checked at .to()): pip install 'ktlite[ray]', or "
            "pip install 'ray[default]==<the image's version>'"
        )


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 2**30


def ray_token(deployment_token: str) -> str:
    """The Ray cluster's auth token (Ray's token mode), derived from the deployment's: its GCS
    runs code for whoever connects, so it asks for a token as every ktlite endpoint does."""
    return hmac.new(deployment_token.encode(), b"ktlite-ray-cluster", hashlib.sha256).hexdigest()


def engine_settings(
    spec: DeploymentSpec,
    ordinal: int,
    pod_ips: list[str],
    pod_names: list[str],
    master_port: int,
    launch_id: str,
    pod_urls: list[str] | None = None,
    token: str | None = None,
    one_machine: bool = False,
) -> dict[str, Any]:
    """Pod ``ordinal``'s engine settings for the deployment's framework. ``pod_urls``: every
    pod server's URL as its peers reach it; ``one_machine``: the pods are processes of one
    machine (the local backend), sharing its memory and ``/dev/shm``."""
    if spec.distributed.framework == "monarch":
        return monarch_host(spec, ordinal, pod_ips, pod_names, master_port, launch_id)
    return ray_node(spec, ordinal, pod_ips, pod_names, master_port, pod_urls, token, one_machine)


def monarch_host(
    spec: DeploymentSpec,
    ordinal: int,
    pod_ips: list[str],
    pod_names: list[str],
    master_port: int,
    launch_id: str,
) -> dict[str, Any]:
    """Pod ``ordinal``'s Monarch worker loop. Pods that share a host (the local backend) talk
    over unix sockets in a directory only this user can enter (Monarch's TCP transport has no
    authentication yet); pods of a cluster over TCP on the pod IP, at a pinned port. Every
    ``.to()`` starts fresh loops (``generation``): a new controller gets hosts without the
    previous one's procs, and their GPU memory."""
    d = spec.distributed
    one_host = len(set(pod_ips)) == 1
    cfg: dict[str, Any] = {
        "kind": "monarch",
        "head": ordinal == 0,
        "ordinal": ordinal,
        "transport": "ipc" if one_host else "tcp",
        "hosts": [
            {"pod": name, "ip": ip, "port": monarch_port(master_port, k)}
            for k, (ip, name) in enumerate(zip(pod_ips, pod_names, strict=True))
        ],
        "per_host": d.procs_per_host or 1,
        "generation": launch_id,
    }
    if one_host:
        key = hashlib.sha256(f"{spec.name}/{launch_id}".encode()).hexdigest()[:12]
        cfg["ipc_dir"] = f"ktmon-{key}"  # under each pod's own temp dir
    return cfg


def object_store(
    memory: int | None, nodes: int, one_machine: bool
) -> tuple[int | None, int | None]:
    """A node's ``(object store, heap)`` in bytes, None where Ray decides. A pod of its own
    machine splits its ``memory`` 30/70. Nodes that share one machine (the local backend) share
    its ``/dev/shm``: each store is at most 512 MiB and an equal share of 30% of the machine,
    whatever ``memory`` says (16Gi × 5 nodes would ask for 24 GiB of one machine's shared
    memory), and the heap is the rest of ``memory``."""
    if one_machine:
        cap = min(LOCAL_OBJECT_STORE_MAX, int(_host_memory() * (1 - HEAP_SHARE) / nodes))
        if memory is not None:
            cap = min(cap, int(memory * (1 - HEAP_SHARE)))
        store = max(MIN_OBJECT_STORE, cap)
        return store, None if memory is None else max(MIN_OBJECT_STORE, memory - store)
    if memory is None:
        return None, None  # Ray reads the pod's own limits
    store = max(MIN_OBJECT_STORE, int(memory * (1 - HEAP_SHARE)))
    return store, max(MIN_OBJECT_STORE, memory - store)


def ray_node(
    spec: DeploymentSpec,
    ordinal: int,
    pod_ips: list[str],
    pod_names: list[str],
    master_port: int,
    pod_urls: list[str] | None = None,
    token: str | None = None,
    one_machine: bool = False,
) -> dict[str, Any]:
    """Pod ``ordinal``'s Ray node: what ``ktlite_server.raynode`` starts. The pods' servers at
    ``pod_urls`` say whether their node failed: a worker node asks the head's rather than wait
    it out, and the head asks the workers' while it waits for them to join. With the
    deployment's ``token``, the cluster uses Ray's token authentication."""
    # several pods at one address share a machine even where the backend did not say so
    one_machine = one_machine or len(set(pod_ips)) < len(pod_ips)
    ports = ray_ports(master_port, ordinal)
    head = ray_ports(master_port, 0)
    res = spec.pod.for_ordinal(ordinal).resources
    memory = res.memory.bytes if res.memory is not None else None
    store, heap = object_store(memory, len(pod_ips), one_machine)
    cfg: dict[str, Any] = {
        "kind": "ray",
        "head": ordinal == 0,
        "address": f"{pod_ips[0]}:{head['gcs']}",
        "node_ip": pod_ips[ordinal],
        "ports": ports,
        "num_cpus": None if res.cpus is None else max(1, math.floor(res.cpus)),
        "num_gpus": spec.pod.pod_gpus(ordinal),
        "memory": heap,
        "object_store_memory": store,
        "version": client_ray_version(),
    }
    if ordinal and pod_urls:
        cfg["head_health"] = f"{pod_urls[0]}/health"
    if token is not None:
        cfg["auth_token"] = ray_token(token)  # a secret: never logged, never in status
    if ordinal == 0:
        cfg["expected"] = [
            {"pod": name, "ip": ip, "port": ray_ports(master_port, k)["node_manager"]}
            for k, (ip, name) in enumerate(zip(pod_ips, pod_names, strict=True))
        ]
        for entry, url in zip(cfg["expected"][1:], (pod_urls or [])[1:], strict=False):
            entry["health"] = f"{url}/health"  # where the head asks whether this node failed
    return cfg
