"""Helpers for code running inside a deployment's ranks.

    from ktlite.distributed import pod_ips
    ips = pod_ips(quorum_workers=4, quorum_timeout=60)

    from ktlite.distributed import monarch_procs      # distribute("monarch"), on pod 0
    procs = monarch_procs()                           # per_host={"gpus": num_proc} on every pod

A pod never needs cluster DNS or the Kubernetes API for this: the client hands every pod
the deployment's pod addresses when it deploys, and each pod's server keeps them current.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import time
from typing import Any

from ktlite.errors import ConfigError, KtliteError


class QuorumNotMet(KtliteError, TimeoutError):
    """``pod_ips`` did not see ``quorum_workers`` pods within ``quorum_timeout``."""


def _known() -> list[str]:
    path = os.environ.get("KTLITE_POD_IPS_FILE")
    if path:
        try:
            with open(path) as f:
                return [str(ip) for ip in json.load(f)["pod_ips"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return [ip for ip in os.environ.get("POD_IPS", "").split(",") if ip]


def _sort_key(ip: str) -> tuple[int, object]:
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


def pod_ips(quorum_workers: int | None = None, quorum_timeout: float = 300.0) -> list[str]:
    """The sorted IP addresses of this deployment's pods, once ``quorum_workers`` are known.

    Args:
        quorum_workers: how many pods to wait for (default: the deployment's ``workers``).
        quorum_timeout: seconds to wait for them; then :class:`QuorumNotMet` is raised,
            never a shorter list.

    Returns one address per pod (on the local backend every pod is 127.0.0.1). ``POD_IPS``
    holds the same addresses in pod (ordinal) order; ``MASTER_ADDR`` is pod 0's.
    """
    if "POD_IPS" not in os.environ and "KTLITE_POD_IPS_FILE" not in os.environ:
        raise KtliteError(
            "pod_ips() works inside a ktlite deployment (a function or class run with "
            "kt.fn/kt.cls/kt.app); this process is not one"
        )
    want = (
        quorum_workers
        if quorum_workers is not None
        else int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    )
    if isinstance(want, bool) or not isinstance(want, int) or want < 1:
        raise ConfigError(f"quorum_workers={quorum_workers!r} must be a whole number >= 1")
    if (
        isinstance(quorum_timeout, bool)
        or not isinstance(quorum_timeout, (int, float))
        or not math.isfinite(quorum_timeout)
        or quorum_timeout < 0
    ):
        raise ConfigError(
            f"quorum_timeout={quorum_timeout!r} must be a finite number of seconds >= 0"
        )
    deadline = time.monotonic() + quorum_timeout
    while True:
        ips = _known()
        if len(ips) >= want:
            return sorted(ips, key=_sort_key)
        if time.monotonic() >= deadline:
            raise QuorumNotMet(
                f"pod_ips(quorum_workers={want}) saw {len(ips)} pod(s) ({', '.join(ips) or 'none'}) "
                f"within quorum_timeout={quorum_timeout:g}s; the deployment has "
                f"{os.environ.get('GROUP_WORLD_SIZE', '?')} worker(s). Deploy with "
                f"distribute(workers={want}), or lower quorum_workers"
            )
        time.sleep(0.2)


_MONARCH_HOSTS: dict[str, Any] = {}  # the HostMesh of this rank process, by launch


def _monarch_env() -> dict[str, Any]:
    raw = os.environ.get("KTLITE_MONARCH")
    if not raw:
        framework = os.environ.get("KTLITE_FRAMEWORK")
        where = (
            "this process is not one"
            if framework is None
            else f"this one is distribute({framework!r})"
            if framework != "monarch"
            else "this is not pod 0, the controller"
        )
        raise KtliteError(
            "monarch_hosts() works in the function of a distribute('monarch', ...) deployment, "
            f"which runs on pod 0 (Monarch's controller); {where}"
        )
    hosts: dict[str, Any] = json.loads(raw)
    return hosts


def monarch_hosts() -> Any:
    """The Monarch ``HostMesh`` of every pod of this ``distribute("monarch")`` deployment
    (one host per pod, in pod order: the mesh's ``hosts`` dimension), attached to the worker
    loops the pod servers run. The same mesh for every call in this process; a new ``.to()``
    gives a new one (fresh loops, without the previous controller's procs).

    Call it before other Monarch calls in the process: it enables Monarch's transport for the
    deployment (TCP on pod 0's IP across pods, unix sockets where the pods share a machine)."""
    cfg = _monarch_env()
    key = cfg["generation"]
    mesh = _MONARCH_HOSTS.get(key)
    if mesh is None:
        from monarch.actor import attach_to_workers, enable_transport

        transport = cfg["controller"]
        try:
            enable_transport(transport)  # the controller's own channel: the pods must reach it
        except RuntimeError as e:
            raise KtliteError(
                f"monarch_hosts() needs Monarch's {transport!r} transport here (the pods reach "
                f"the controller through it), and this process enabled another: {e}. Call "
                "monarch_hosts() or monarch_procs() before other Monarch calls"
            ) from e
        # torchmonarch has no TLS yet: the loops listen on pod IPs (or private unix sockets)
        mesh = attach_to_workers(
            ca="trust_all_connections", workers=list(cfg["workers"]), name=f"ktlite-{key}"
        )
        _MONARCH_HOSTS.clear()
        _MONARCH_HOSTS[key] = mesh
    return mesh


def monarch_procs(per_host: dict[str, int] | None = None, **kwargs: Any) -> Any:
    """``monarch_hosts().spawn_procs(per_host=...)``: by default ``{"gpus": num_proc}``, the
    ``num_proc`` of ``distribute("monarch", workers=N, num_proc=P)``; other keywords go to
    ``spawn_procs``. Stop the mesh (``procs.stop()``) when done with it: its procs otherwise
    live until the next ``.to()`` or the teardown."""
    cfg = _monarch_env()
    return monarch_hosts().spawn_procs(
        per_host=per_host or {"gpus": int(cfg["per_host"])}, **kwargs
    )
