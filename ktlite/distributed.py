"""Helpers for code running inside a deployment's ranks.

    from ktlite.distributed import pod_ips
    ips = pod_ips(quorum_workers=4, quorum_timeout=60)

A pod never needs cluster DNS or the Kubernetes API for this: the client hands every pod
the deployment's pod addresses when it deploys, and each pod's server keeps them current.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import time

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
        raise KtliteError("pod_ips() works inside a ktlite deployment (a function or class run with "
                          "kt.fn/kt.cls/kt.app); this process is not one")
    want = quorum_workers if quorum_workers is not None else int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    if isinstance(want, bool) or not isinstance(want, int) or want < 1:
        raise ConfigError(f"quorum_workers={quorum_workers!r} must be a whole number >= 1")
    if isinstance(quorum_timeout, bool) or not isinstance(quorum_timeout, (int, float)) \
            or not math.isfinite(quorum_timeout) or quorum_timeout < 0:
        raise ConfigError(f"quorum_timeout={quorum_timeout!r} must be a finite number of seconds >= 0")
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
                f"distribute(workers={want}), or lower quorum_workers")
        time.sleep(0.2)
