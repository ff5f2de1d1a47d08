"""The pod table of a fixed-pods deployment (``status``, ``restart_failed``), asked of pod 0
alone, which gathers it down the call tree (``ktlite_server.podtable``): one request from the
caller at any pod count (through a Kubernetes API server's pod proxy, one proxied request, not
one per pod). One pod, or pods whose ordinals are not 0..N-1, are asked one by one.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ktlite.errors import NotDeployedError, PodUnreachable
from ktlite.modes.callpath import pool
from ktlite_wire.calltree import LaunchRelay

if TYPE_CHECKING:
    from ktlite.modes.fanout import Fanout

STATUS_S = 10.0  # pod 0's budget for the whole table (each pod measures its ranks' CPU)
SLACK_S = 5.0  # the caller waits this much longer than pod 0's budget


def relay(mode: Fanout, timeout: float) -> str | None:
    """The ``x-ktlite-tree`` header naming every pod (down the call tree from
    ``tree_minimum`` pods on, else pod 0 asks each); None where the caller asks each pod."""
    eps = mode.endpoints
    if len(eps) < 2 or [ep.ordinal for ep in eps] != list(range(len(eps))):
        return None
    fanout = mode.spec.distributed.tree(len(eps)) or len(eps) - 1
    return LaunchRelay(
        [ep.peer_url for ep in eps],
        [ep.name for ep in eps],
        list(range(len(eps))),
        fanout,
        float(timeout),
        f"{sys.version_info.major}.{sys.version_info.minor}",
    ).encode()


def entries(mode: Fanout, stuck_after: float | None = None) -> list[dict[str, Any]]:
    """Every pod's status in ordinal order; a pod that pod 0 could not ask is an entry with
    ``error`` (pod 0 itself failing raises, as a pod asked alone does)."""
    header = relay(mode, STATUS_S)
    eps = mode.endpoints
    if header is None:
        futures = [pool.submit(mode.client.status, ep.url, stuck_after) for ep in eps]
        return [f.result() for f in futures]
    table: list[dict[str, Any]] = mode.client.status(
        eps[0].url, stuck_after, relay=header, timeout=STATUS_S + SLACK_S
    )
    return table


def raise_errors(table: list[dict[str, Any]], what: str) -> None:
    """The error of the first entries that carry one: NotDeployedError where a pod refused for
    lack of code (409), else PodUnreachable; each such pod named."""
    bad = [e for e in table if "error" in e]
    if not bad:
        return
    shown = "; ".join(f"{e['pod']}: {e['error']}" for e in bad[:5]) + (
        f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
    )
    message = f"{what}: {len(bad)} pod(s) did not answer: {shown}"
    if all(e.get("code") == 409 for e in bad):
        raise NotDeployedError(message)
    raise PodUnreachable(message)


def restart_failed(mode: Fanout) -> dict[str, Any]:
    """Restart the dead rank processes on every pod (only those); pod 0 last, so the process
    group is re-formed at the next call."""
    timeout = mode.spec.pod.calls.launch_timeout + 30
    eps = mode.endpoints
    header = relay(mode, timeout)
    if header is None:
        futures = [pool.submit(mode.client.restart_failed, ep.url, timeout) for ep in eps[1:]]
        answers = [f.result() for f in futures]
        regroup = any(a["restarted"] for a in answers)
        answers.insert(0, mode.client.restart_failed(eps[0].url, timeout, regroup=regroup))
    else:
        answers = mode.client.restart_failed(eps[0].url, timeout + SLACK_S, relay=header)
        raise_errors(answers, f"restarting the failed ranks of {mode.name!r}")
    return {
        "restarted": sorted(r for a in answers for r in a["restarted"]),
        "failed": [f for a in answers for f in a["failed"]],
        "pods": answers,
    }
