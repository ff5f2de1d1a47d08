"""A deployment's pod table gathered down the call tree: ``GET /status`` and ``POST
/restart_failed`` with the ``x-ktlite-tree`` header (:class:`ktlite_wire.calltree.LaunchRelay`:
every pod's address and name, the subtree this pod answers for, the fan-out, the time budget).

The caller asks pod 0 once (from outside a Kubernetes cluster, through the API server's pod
proxy: one request, not one per pod). Each pod answers for itself and, at the same time, asks
its children (each the first pod of a contiguous run of its subtree, ``calltree.split``) with
their runs and a smaller budget; the answer is a JSON list, one entry per pod of the subtree
in ordinal order. A child that cannot be reached in time, or answers with an error, is an
entry per pod of its run saying so (``error``, and ``code`` when a pod refused), so the
others still show and nothing waits past the budget.

``restart_failed`` asks the pods below first, then this pod, telling it to regroup when a
pod below restarted a rank: on pod 0 that re-forms the process group at the next call, as
when the caller asked every other pod and then pod 0.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from ktlite_server.peers import PeerError, PeerPool, error_text
from ktlite_wire import calltree
from ktlite_wire.headers import TREE_HEADER

SHRINK = 0.8  # of this pod's time budget, a child's for its subtree: answers come back in time
Entry = dict[str, Any]


def parse(header: str | None, ordinal: int) -> calltree.LaunchRelay | None:
    """The relay the header names (None without one); ValueError when malformed or meant for
    another pod."""
    if header is None:
        return None
    relay = calltree.LaunchRelay.decode(header)
    if relay.subtree[0] != ordinal:
        raise ValueError(f"the request for pod {relay.subtree[0]} reached ordinal {ordinal}")
    return relay


async def statuses(
    peers: PeerPool, relay: calltree.LaunchRelay, own: Awaitable[Entry], params: dict[str, str]
) -> list[Entry]:
    """This pod's status (``own``) and its subtree's, in ordinal order."""
    mine, below = await asyncio.gather(own, _below(peers, relay, "GET", "/status", params))
    return [mine, *below]


async def restarts(
    peers: PeerPool, relay: calltree.LaunchRelay, own: Callable[[bool], Awaitable[Entry]]
) -> list[Entry]:
    """Restart the dead ranks below, then here (``own(regroup)``); each pod's answer."""
    below = await _below(peers, relay, "POST", "/restart_failed", {})
    mine = await own(any(entry.get("restarted") for entry in below))
    return [mine, *below]


async def _below(
    peers: PeerPool, relay: calltree.LaunchRelay, method: str, path: str, params: dict[str, str]
) -> list[Entry]:
    children = calltree.split(relay.subtree[1:], relay.fanout)
    answers = await asyncio.gather(
        *(_child(peers, relay, sub, method, path, params) for sub in children)
    )
    return [entry for entries in answers for entry in entries]


async def _child(
    peers: PeerPool,
    relay: calltree.LaunchRelay,
    subtree: list[int],
    method: str,
    path: str,
    params: dict[str, str],
) -> list[Entry]:
    first, budget = subtree[0], relay.timeout * SHRINK
    below = relay.below(subtree, budget)
    code: int | None = None
    try:
        status, body = await peers.request(
            method,
            relay.url(first) + path,
            params=params,
            headers={TREE_HEADER: below.encode()},
            timeout=budget,
        )
        if status == 200:
            entries = json.loads(body)
            if isinstance(entries, list) and len(entries) == len(subtree):
                return entries
            why = (
                f"pod {relay.name(first)} answered {path} with something other than a list of "
                f"{len(subtree)} entries, one per pod of its subtree"
            )
        else:
            code = status
            text = error_text(body)
            why = f"pod {relay.name(first)} answered {path} with HTTP {status}: {text}"
    except PeerError as e:
        why = f"pod {relay.name(first)} could not be asked for {path} (budget {budget:.3g}s): {e}"
    except (ValueError, TypeError) as e:
        why = f"pod {relay.name(first)} answered {path} with something that is not a list: {e}"
    via = (
        f" (asked through pod {relay.name(first)}, which did not answer)"
        if len(subtree) > 1
        else ""
    )
    return [
        {
            "pod": relay.name(j),
            "ordinal": j,
            "error": why if j == first else why + via,
            "code": code,
            "ranks": [],
            "restarted": [],
            "failed": [],
        }
        for j in subtree
    ]
