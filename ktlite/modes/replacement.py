"""Pods the backend replaced under a fixed-pods deployment (a deleted pod came back with a
new IP, a container restarted: either has none of our code): noticing them, explaining a
call they broke, and healing (waiting for them and pushing the code again).

Used by :class:`ktlite.modes.fanout.Fanout`; no call is sent again once a rank may have run it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any
from urllib.parse import urlsplit

from ktlite.backends.base import Applied
from ktlite.errors import NotDeployedError, RankFailure, RemoteError, WorkerMembershipChanged
from ktlite.modes.callpath import CallPath

logger = logging.getLogger(__name__)


class Replacements:
    """Which pods of ``dep`` were replaced since its code was pushed, and healing them."""

    def __init__(self, dep: CallPath) -> None:
        self.dep = dep
        self.suspect = False  # a call lost a pod: check for replaced pods before the next one

    def ordinal_of(self, pod: str) -> int:
        return next((ep.ordinal for ep in self.dep.endpoints if ep.name == pod), -1)

    def replaced(self, ordinals: list[int], current: Applied | None = None) -> list[str]:
        """Names of the pods among ``ordinals`` that the backend replaced since we pushed code."""
        if not ordinals:
            return []
        current = current or self.dep.backend.lookup(self.dep.name)
        if current is None:
            return []
        now = {ep.ordinal: ep.incarnation for ep in current.endpoints}
        return [
            ep.name
            for ep in self.dep.endpoints
            if ep.ordinal in ordinals and ep.incarnation and now.get(ep.ordinal) != ep.incarnation
        ]

    def _ips(self, applied: Applied | None) -> list[str]:
        """Each pod's address by ordinal: its IP, or host:port where pods share one host."""
        if applied is None:
            return []
        eps = sorted(applied.endpoints, key=lambda ep: ep.ordinal)
        return [urlsplit(ep.peer_url).netloc if applied.same_host else ep.ip for ep in eps]

    def membership_changed(
        self, ordinals: list[int], error: RemoteError, failures: list[RankFailure]
    ) -> WorkerMembershipChanged | None:
        """The call's error as :class:`WorkerMembershipChanged` when pods among ``ordinals``
        were lost or replaced (not merely a rank process that died on a pod that lives on)."""
        try:
            current = self.dep.backend.lookup(self.dep.name)
            gone = (
                self.replaced(ordinals, current)
                if current is not None
                else [ep.name for ep in self.dep.endpoints if ep.ordinal in ordinals]
            )
        except Exception:  # noqa: BLE001 - the call's own error is what matters then
            return None
        if not gone:
            return None
        return self.membership_error(gone, current, str(error), failures, error.outcomes)

    def membership_error(
        self,
        gone: list[str],
        current: Applied | None,
        detail: str,
        failures: list[RankFailure] | None = None,
        outcomes: dict[int, Any] | None = None,
    ) -> WorkerMembershipChanged:
        self.suspect = True  # the next call waits for the replacements and pushes the code
        return WorkerMembershipChanged(
            f"pod(s) {', '.join(gone)} of {self.dep.name!r} were lost or replaced during the call; the "
            f"next call runs on their replacements (the code is pushed again"
            f"{', class instances are created anew' if self.dep.spec.kind == 'cls' else ''}).\n{detail}",
            failures,
            outcomes,
            previous_ips=self._ips(self.dep.applied),
            current_ips=self._ips(current),
        )

    def pod_state(self, ordinal: int, current: Applied) -> str:
        ep = self.dep.endpoints[ordinal]
        now = next((c for c in current.endpoints if c.ordinal == ordinal), None)
        if now is None:
            return f"Pod {ep.name} is gone or not running; the next call waits for its replacement."
        if ep.incarnation and now.incarnation != ep.incarnation:
            return (
                f"Pod {ep.name} was replaced (now at {now.ip}); the next call pushes the code to "
                "it."
            )
        return f"Pod {ep.name} still runs at {ep.ip}: it may be overloaded; see remote.logs()."

    def heal(self, why: str) -> bool:
        """If the backend replaced pods since the code was pushed, wait for them and push the
        code again; False when nothing was replaced. Raises NotDeployedError when the
        deployment was torn down or re-created by someone else."""
        current = self.dep.backend.lookup(self.dep.name)
        if current is None or current.token != self.dep.applied.token:
            raise NotDeployedError(
                f"deployment {self.dep.name!r} was torn down or re-created; call .to(compute) again"
            )
        if (
            current.spec_hash
            and self.dep.applied.spec_hash
            and current.spec_hash != self.dep.applied.spec_hash
        ):
            raise NotDeployedError(
                f"deployment {self.dep.name!r} was redeployed with another Compute (by "
                "another process?); call .to(compute) again"
            )
        gone = self.replaced([ep.ordinal for ep in self.dep.endpoints], current)
        if not gone:
            self.suspect = False
            return False
        if self.dep.code is None:
            raise NotDeployedError(
                f"pod(s) {', '.join(gone)} of {self.dep.name!r} were replaced; call .to(compute) again"
            )
        kind = (
            " (class instances are created anew on every pod)"
            if self.dep.spec.kind == "cls"
            else ""
        )
        logger.warning(
            "%s: pod(s) %s were replaced (%s); waiting for them and pushing the code again%s",
            self.dep.name,
            ", ".join(gone),
            why,
            kind,
        )
        applied = self.dep.backend.apply(self.dep.spec, self.dep.applied.token)
        self.dep.applied = applied
        self.dep.push(*self.dep.code)
        self.suspect = False
        return True


class ReplacedWatch:
    """Reads the coordinator's notices during a call: when it cannot reach some pods yet and
    the backend shows them replaced (their old IPs swallow packets, so the wait would last
    ``quorum_timeout``), it cancels the call, which no rank has started yet."""

    def __init__(self, pods: Replacements, call_id: str) -> None:
        self.pods, self.call_id = pods, call_id
        self.replaced: list[str] = []
        self._checked = 0.0

    def __call__(self, info: dict[str, Any]) -> None:
        if info.get("kind") != "waiting" or self.replaced or time.monotonic() - self._checked < 2.0:
            return
        self._checked = time.monotonic()
        with contextlib.suppress(Exception):  # a failed check only means we keep waiting
            gone = self.pods.replaced([int(i) for i in info.get("pods") or []])
            if gone:
                self.replaced.extend(gone)
                self.pods.dep.client.cancel(
                    self.pods.dep.endpoints[0].url,
                    self.call_id,
                    f"pod(s) {', '.join(gone)} were replaced",
                )
