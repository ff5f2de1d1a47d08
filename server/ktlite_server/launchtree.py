"""A code push relayed down the call tree: ``POST /deploy`` with the ``x-ktlite-tree`` header.

The caller sends a deployment's launch once, to pod 0, naming every pod
(:class:`ktlite_wire.calltree.LaunchRelay`). Each pod installs it with its own ordinal (unless
it runs another Python minor than the caller: the code is cloudpickled bytecode) and, at the
same time, sends the same body to each of its children with the child's subtree, retrying a
child that does not accept connections yet (a pod still starting) up to the relay's timeout
(but not one whose TLS certificate is another deployment's: that fails at once).
The answers of the whole subtree come back in one result: a child's result is passed on as
it came, nested in this pod's (as a call's is: only the caller decodes it); a child that
cannot be reached, or answers with an error, is reported with every rank of its subtree,
never left out.
"""

from __future__ import annotations

import asyncio
import platform
import ssl
import time
from typing import Any

from ktlite_server.peers import PeerConnectError, PeerError, PeerPool, error_text
from ktlite_wire import calltree
from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.errors import ProtocolError
from ktlite_wire.headers import LENGTH_HEADER, TREE_HEADER
from ktlite_wire.outcome import CallResult, RankOutcome, Subtree
from ktlite_wire.status import Status

RETRY_S = 0.2  # between attempts at a child that is not listening yet


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


class LaunchRelayFailed(Exception):
    """A child of the tree could not take the launch; the message says why."""


def python_mismatch(
    relay: calltree.LaunchRelay, layout: DistributedLayout, ordinal: int
) -> list[RankOutcome] | None:
    """This pod's ranks as failed when it runs another Python minor than the caller, whose
    cloudpickled bytecode only a matching minor runs; None when it matches."""
    ours = platform.python_version()
    if not relay.python or _minor(ours) == _minor(relay.python):
        return None
    message = (
        f"pod {relay.name(ordinal)} runs Python {ours}, the caller Python {relay.python}: code "
        "shipped by cloudpickle needs the same minor version; use an image with Python "
        f"{_minor(relay.python)} for every pod"
    )
    return _subtree_failed(relay, layout, [ordinal], message)


def _subtree_failed(
    relay: calltree.LaunchRelay, layout: DistributedLayout, subtree: list[int], message: str
) -> list[RankOutcome]:
    now = time.time()
    return [
        RankOutcome(r, relay.name(j), Status.DIED, None, message, now)
        for j in subtree
        for r in range(layout.first_rank(j), layout.first_rank(j) + layout.procs(j))
    ]


async def _child(
    peers: PeerPool,
    relay: calltree.LaunchRelay,
    layout: DistributedLayout,
    subtree: list[int],
    body: Any,
) -> Subtree | list[RankOutcome]:
    """The child's result as it came (its head read, its rows not decoded), or its whole
    subtree's ranks as failed, naming why."""
    i = subtree[0]
    url, name = relay.url(i), relay.name(i)
    deadline = time.monotonic() + relay.timeout
    view = memoryview(body).cast("B")
    headers = {
        TREE_HEADER: relay.below(subtree).encode(),
        LENGTH_HEADER: str(view.nbytes),
        "content-type": "application/octet-stream",
    }
    try:
        while True:  # a child still starting refuses connections: nothing was sent, retry
            try:
                status, data = await _post(peers, url, headers, view, relay.timeout + 30)
                break
            except PeerConnectError as e:
                if isinstance(e.__cause__, ssl.SSLCertVerificationError):
                    # another deployment's server at that address: waiting cannot make it ours
                    raise LaunchRelayFailed(f"pod {name} at {url}: {e}") from e
                if time.monotonic() + RETRY_S >= deadline:
                    raise LaunchRelayFailed(
                        f"pod {name} at {url} was not reachable within {relay.timeout:g}s: {e}"
                    ) from e
            await asyncio.sleep(RETRY_S)  # a retry with a pause, bounded by the deadline
        if status != 200:
            text = error_text(data)
            raise LaunchRelayFailed(f"pod {name} answered the deploy with HTTP {status}: {text}")
        return Subtree.peek(data)
    except LaunchRelayFailed as e:
        why = str(e)
    except (PeerError, ProtocolError) as e:
        why = f"lost the connection to pod {name} during the deploy: {e}"
    below = (
        f"; the {len(subtree) - 1} pod(s) it relays the launch to did not get it either"
        if len(subtree) > 1
        else ""
    )
    return _subtree_failed(relay, layout, subtree, why + below)


async def _post(
    peers: PeerPool, url: str, headers: dict[str, str], body: memoryview, timeout: float
) -> tuple[int, bytes]:
    async with peers.post(
        url, "/deploy", headers, body, connect_timeout=5.0, read_timeout=timeout
    ) as resp:
        return resp.status, await resp.read()


async def relay(
    peers: PeerPool, relay: calltree.LaunchRelay, layout: DistributedLayout, body: Any
) -> CallResult:
    """Send the launch ``body`` to the children of this pod's subtree; their answers: each
    child's result passed on undecoded (``subtrees``), and for a child that failed every rank
    below it, as DIED, naming why (``outcomes``)."""
    children = calltree.split(relay.subtree[1:], relay.fanout)
    answers = await asyncio.gather(*(_child(peers, relay, layout, sub, body) for sub in children))
    failed = [o for got in answers if not isinstance(got, Subtree) for o in got]
    return CallResult(failed, subtrees=[got for got in answers if isinstance(got, Subtree)])
