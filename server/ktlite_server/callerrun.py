"""The caller's call to this pod alone, over the caller's link (``ktlite.net.podlinks``): a
``RUN`` flagged ``COORDINATE`` (``linkframes.caller_run``), run on the lean path of a member's
``RUN`` (``memberrun``: the same checks, ``Pod.run``'s admission and "a call id runs at most
once", one task, log lines as ``DATA`` while it runs, one binary ``DONE``), without the call
plan, the call stream, the produce task and the result envelope of ``Calls.call``.

What this pod does as the call's coordinator, it does here as ``Calls.call`` does for a call to
it alone: the process group's generation and port are its own; a distributed deployment that
runs one call at a time runs them in the order they came (``Pod.order``); a call that did not
end well on every rank moves the deployment to a new generation. A stop is ``POST /cancel`` (its
``Pod.cancel``) or ``CLOSE`` (the caller stopped waiting). What needs more (a timeout, several
pods, per-rank items, arguments in shared memory, a re-attach window) is a ``CALL``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ktlite_server.linkserver import LinkServer
from ktlite_server.memberrun import MemberRuns, _MemberCall
from ktlite_server.ranks import Outcome
from ktlite_wire import linkframes
from ktlite_wire.status import Status


class LinkRuns(MemberRuns):
    """Every ``RUN`` that comes over a link: a member's share of a call (``memberrun``), or the
    caller's call to this pod (``COORDINATE``)."""

    def _call(self, link: LinkServer, stream: int, run: linkframes.Run) -> _MemberCall:
        if run.flags & linkframes.COORDINATE:
            return _CallerRun(self.pod, link, stream, run)
        return _MemberCall(self.pod, link, stream, run)


class _CallerRun(_MemberCall):
    """A caller's ``RUN``: this pod coordinates it."""

    def _send_done(self, parts: list[Any]) -> None:
        # with the other answers that end in this turn of the loop: one write, one wake of the
        # caller's reader for them all (the calls of one link end together when their rank
        # answers them in one read)
        self.link.post(parts)

    def _group(self) -> tuple[int, int | None]:
        return self.pod.generation, self.pod.group_port  # this pod coordinates: its own

    def _after(self, outs: list[Outcome]) -> None:
        if any(o.status is not Status.OK for o in outs):
            # a failed or stopped call may leave ranks out of step in their process group:
            # the next call forms a new one (every rank, on a new port)
            self.pod.next_generation()

    def _ordered(self) -> bool:
        """Collectives run in the same order on every rank: a distributed deployment that runs
        one call at a time takes them in the order they came (as ``Calls.call``)."""
        dep = self.pod.dep
        return dep is not None and dep.concurrency == 1 and dep.config.world_size > 1

    def now(self) -> bool:
        return not self._ordered() and super().now()

    async def _ranks(self, log: Callable[[int, str, str], None] | None) -> list[Outcome]:
        order: Any = self.pod.order if self._ordered() else contextlib.nullcontext()
        async with order:
            return await super()._ranks(log)
