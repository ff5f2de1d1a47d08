"""A code push relayed down the call tree: ``POST /deploy`` with the ``x-ktlite-tree`` header.

The caller sends a deployment's launch once, to pod 0, naming every pod
(:class:`ktlite_wire.calltree.LaunchRelay`). Each pod installs it with its own ordinal and, at
the same time, waits for each of its children to answer ``/health`` (a pod still starting,
up to the relay's timeout), checks it runs the same Python minor (the code is cloudpickled
bytecode), and sends it the same body with the child's subtree. The answers of the whole
subtree come back in one result: a child that cannot be reached, or answers with an error,
is reported with every rank of its subtree, never left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import time
from typing import Any

from ktlite_server.peers import PeerError, PeerPool
from ktlite_wire import calltree
from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.errors import ProtocolError
from ktlite_wire.headers import LENGTH_HEADER, TREE_HEADER
from ktlite_wire.outcome import CallResult, RankOutcome
from ktlite_wire.status import Status

RETRY_S = 0.2  # between /health attempts at a child that is not up yet


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


class LaunchRelayFailed(Exception):
    """A child of the tree could not take the launch; the message says why."""


async def _ready(peers: PeerPool, url: str, name: str, deadline: float) -> None:
    """Wait until the pod at ``url`` answers ``/health`` (up to ``deadline``), and check its
    Python minor against this pod's."""
    last = ""
    while True:
        left = deadline - time.monotonic()
        try:
            health = await peers.get_json(
                url.rstrip("/") + "/health", timeout=max(0.5, min(left, 5.0))
            )
            break
        except PeerError as e:
            last = str(e)
        if time.monotonic() + RETRY_S >= deadline:
            raise LaunchRelayFailed(f"pod {name} at {url} did not answer /health in time: {last}")
        await asyncio.sleep(RETRY_S)  # a retry with a pause, bounded by the deadline
    theirs, ours = str(health.get("python") or ""), platform.python_version()
    if theirs and _minor(theirs) != _minor(ours):
        raise LaunchRelayFailed(
            f"pod {name} at {url} runs Python {theirs}, pod 0's Python {ours}: code shipped by "
            f"cloudpickle needs the same minor version on every pod; use one image for all"
        )


def _subtree_failed(
    relay: calltree.LaunchRelay, layout: DistributedLayout, subtree: list[int], message: str
) -> list[RankOutcome]:
    now = time.time()
    return [
        RankOutcome(r, relay.names[j], Status.DIED, None, message, now)
        for j in subtree
        for r in range(layout.first_rank(j), layout.first_rank(j) + layout.procs(j))
    ]


async def _child(
    peers: PeerPool,
    relay: calltree.LaunchRelay,
    layout: DistributedLayout,
    subtree: list[int],
    body: Any,
) -> list[RankOutcome]:
    i = subtree[0]
    url, name = relay.pods[i], relay.names[i]
    try:
        await _ready(peers, url, name, time.monotonic() + relay.timeout)
        view = memoryview(body).cast("B")
        headers = {
            TREE_HEADER: relay.below(subtree).encode(),
            LENGTH_HEADER: str(view.nbytes),
            "content-type": "application/octet-stream",
        }
        async with peers.post(
            url, "/deploy", headers, view, connect_timeout=5.0, read_timeout=relay.timeout + 30
        ) as resp:
            data = await resp.read()
            if resp.status != 200:
                text = data.decode(errors="replace")[:500]
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    text = json.loads(text)["detail"]
                raise LaunchRelayFailed(
                    f"pod {name} answered the deploy with HTTP {resp.status}: {text}"
                )
        return CallResult.decode(bytearray(data)).outcomes
    except LaunchRelayFailed as e:
        why = str(e)
    except (PeerError, ProtocolError) as e:
        why = f"lost the connection to pod {name} during the deploy: {e}"
    below = (
        f"; the launch is relayed through it to pod(s) {len(subtree) - 1} more"
        if len(subtree) > 1
        else ""
    )
    return _subtree_failed(relay, layout, subtree, why + below)


async def relay(
    peers: PeerPool, relay: calltree.LaunchRelay, layout: DistributedLayout, body: Any
) -> list[RankOutcome]:
    """Send the launch ``body`` to the children of this pod's subtree; their whole subtrees'
    outcomes (a child that failed: every rank below it, as DIED, naming why)."""
    children = calltree.split(relay.subtree[1:], relay.fanout)
    answers = await asyncio.gather(*(_child(peers, relay, layout, sub, body) for sub in children))
    return [o for outs in answers for o in outs]
