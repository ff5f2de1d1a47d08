"""``inactivity_ttl`` in the ``ktlite`` command: the IDLE and DEADLINE columns of ``ktlite
list``, and the sweep that ``ktlite list`` and ``ktlite teardown --expired`` run.

A backend's list rows may carry ``idle_s`` (how long its pod 0 has gone without a call) and
``ttl_s`` (its ``inactivity_ttl``). A deployment idle for longer than its TTL has expired:
where its pods could not delete it themselves (Kubernetes pods that cannot reach the API
server), the next client to list or sweep tears it down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ktlite.backends.base import Backend


def duration(seconds: float) -> str:
    """``45s``, ``3m12s``, ``2h05m``, ``3d04h``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def columns(row: dict[str, Any]) -> tuple[str, str]:
    """(IDLE, DEADLINE) of a list row: ``-`` where the backend does not know them."""
    idle, ttl = row.get("idle_s"), row.get("ttl_s")
    idle_text = duration(idle) if idle is not None else "-"
    if ttl is None:
        return idle_text, "-"
    if idle is None:
        return idle_text, f"ttl {duration(ttl)}"
    left = ttl - idle
    return idle_text, f"in {duration(left)}" if left > 0 else "expired"


def is_expired(row: dict[str, Any]) -> bool:
    idle, ttl = row.get("idle_s"), row.get("ttl_s")
    return idle is not None and ttl is not None and idle > ttl


def why(row: dict[str, Any]) -> str:
    return f"idle {duration(row['idle_s'])}, inactivity_ttl {duration(row['ttl_s'])}"


def sweep(
    backend: Backend,
    rows: list[dict[str, Any]],
    *,
    dry_run: bool = False,
    timeout: float = 60.0,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Tear down the deployments of ``rows`` that have expired (with ``dry_run``, only say
    which would be); returns their names."""
    names = []
    for row in rows:
        if not is_expired(row):
            continue
        names.append(row["name"])
        if dry_run:
            say(f"{row['name']}: would be torn down ({why(row)})")
            continue
        backend.teardown(row["name"], timeout=timeout)
        say(f"{row['name']}: torn down ({why(row)})")
    return names
