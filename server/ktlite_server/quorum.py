"""The quorum of a fan-out: every pod a call goes to reachable before any rank starts, so a job
never runs with fewer ranks (``Coordinator``). Free when each link or keep-alive connection
carried an answer within the last seconds (``PeerPool.stale``); else each missing pod is
probed (``PeerPool.ensure``) up to the plan's ``quorum_timeout``. Every ``NOTICE_AFTER_S``
the caller hears which pods are missing (it may know they were replaced, and cancel); a
cancel ends the wait at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from typing import Any

from ktlite_server.peers import PeerPool
from ktlite_wire import frames
from ktlite_wire.outcome import RankOutcome
from ktlite_wire.plan import CallPlan
from ktlite_wire.status import Status

REFUSED_GRACE_S = 5.0  # how long a peer may refuse connections before the call fails
NOTICE_AFTER_S = 2.0  # the caller hears of pods not reachable yet after this, and this often
# the ranks of pod i (and of its subtree) failed with this message and status
FailedPod = Callable[..., list[RankOutcome]]


async def wait(
    peers: PeerPool,
    plan: CallPlan,
    missing: list[int],
    members: list[int],
    emit: Callable[[Any], None],
    wake: asyncio.Event,
    stopped: Callable[[], bool],
    failed_pod: FailedPod,
) -> list[RankOutcome]:
    """Wait for the ``missing`` pods (of the call's ``members``); the outcomes of every
    member when some stay unreachable (no rank started), else none. ``wake`` is set when the
    call is cancelled (``stopped()`` then says so)."""
    start = time.monotonic()
    errors: dict[int, str] = {}
    noticed = start
    while missing and not stopped():
        left = max(0.5, min(NOTICE_AFTER_S, plan.quorum_timeout - (time.monotonic() - start)))
        probes = asyncio.ensure_future(
            asyncio.gather(
                *(peers.ensure(plan.url(i), left) for i in missing),
                return_exceptions=True,
            )
        )
        woken = asyncio.ensure_future(wake.wait())
        racing: set[asyncio.Future[Any]] = {probes, woken}
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if not probes.done():  # cancelled mid-probe
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
            break
        got = probes.result()
        failures = {i: e for i, e in zip(missing, got, strict=True) if isinstance(e, BaseException)}
        errors = {i: str(e) for i, e in failures.items()}
        missing = list(errors)
        waited = time.monotonic() - start
        # nothing listening at all: the server is gone, and one that restarts has lost the
        # deployment's code anyway: waiting out quorum_timeout would only delay the error;
        # a server that is not this deployment's (its TLS certificate is another's) will
        # not become it: the call fails at once
        refused = bool(failures) and all(
            isinstance(e.__cause__, ConnectionRefusedError) for e in failures.values()
        )
        foreign = any(
            isinstance(e.__cause__, ssl.SSLCertVerificationError) for e in failures.values()
        )
        if (
            not missing
            or foreign
            or waited >= plan.quorum_timeout
            or (refused and waited >= REFUSED_GRACE_S)
        ):
            break
        if time.monotonic() - noticed >= NOTICE_AFTER_S:
            noticed = time.monotonic()
            names = ", ".join(plan.name(i) for i in missing)
            emit(
                frames.notice_frame(
                    "waiting",
                    f"waiting for pod(s) {names} to be reachable ({waited:.0f}s of "
                    f"quorum_timeout={plan.quorum_timeout:g}s; no rank has started)",
                    pods=missing,
                    waited=waited,
                )
            )
        await asyncio.sleep(0.2)
    if not missing or stopped():
        return []
    unreached = [plan.name(i) for i in missing]
    reached = len(plan.pods) - len(missing)
    outs: list[RankOutcome] = []
    for i in members:
        if i in errors:
            outs += failed_pod(
                plan,
                i,
                (
                    f"pod {plan.name(i)} at {plan.url(i)} was not reachable "
                    f"(waited {time.monotonic() - start:.1f}s of quorum_timeout={plan.quorum_timeout:g}s: "
                    f"{errors[i]}); {reached} of "
                    f"{len(plan.pods)} pods were; no rank started. Check that the pod is running, or "
                    "raise distribute(quorum_timeout=...)"
                ),
                status=Status.UNREACHABLE,
            )
        else:
            outs += failed_pod(
                plan,
                i,
                f"not started: pod(s) {', '.join(unreached)} unreachable",
                status=Status.CANCELLED,
            )
    return outs
