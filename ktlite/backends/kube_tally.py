"""A deployment's pods 0..N-1 as the readiness wait counts them: which are there (running their
StatefulSet's template, not being deleted), scheduled, running and Ready. Each change costs
O(1), so a watch's thousands of events over a thousand pods stay cheap."""

from __future__ import annotations

from typing import Any

from ktlite.backends import kube_pods as kp


def _flags(pod: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(scheduled, running, Ready)."""
    status = pod.get("status") or {}
    scheduled = any(
        c.get("type") == "PodScheduled" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return scheduled, status.get("phase") == "Running", kp.is_ready(pod)


def _ordinal(name: str) -> int:
    """The ordinal a StatefulSet pod's name ends with; -1 for another name."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


class PodTally:
    """Pods by ordinal (``want``: ordinal → the pod hash its StatefulSet asks for)."""

    def __init__(self, total: int, want: dict[int, str]) -> None:
        self.total, self.want = total, want
        self._pods: dict[int, dict[str, Any]] = {}
        self._flags: dict[int, tuple[bool, bool, bool]] = {}
        self._counts = [0, 0, 0]  # scheduled, running, Ready

    def update(self, name: str, pod: dict[str, Any] | None) -> dict[str, Any] | None:
        """Take ``pod`` (None: gone) as the pod called ``name`` now; the pod if it counts."""
        ordinal = _ordinal(name)
        if not 0 <= ordinal < self.total:
            return None
        current = (
            pod is not None
            and kp.pod_hash(pod) == self.want.get(ordinal)
            and not pod["metadata"].get("deletionTimestamp")
        )
        old = self._flags.pop(ordinal, (False, False, False))
        self._pods.pop(ordinal, None)
        new = (False, False, False)
        if current:
            assert pod is not None
            self._pods[ordinal] = pod
            new = self._flags[ordinal] = _flags(pod)
        for i in range(3):
            self._counts[i] += new[i] - old[i]
        return pod if current else None

    def pod(self, name: str) -> dict[str, Any] | None:
        """The pod called ``name`` if it counts."""
        pod = self._pods.get(_ordinal(name))
        return pod if pod is not None and pod["metadata"]["name"] == name else None

    def done(self) -> bool:
        return self._counts[2] == self.total

    def pods(self) -> list[dict[str, Any]]:
        return [self._pods[i] for i in range(self.total)]

    def not_ready(self) -> list[tuple[int, dict[str, Any] | None]]:
        """(ordinal, the pod or None) of each pod that is not Ready, in ordinal order."""
        return [
            (i, self._pods.get(i))
            for i in range(self.total)
            if not self._flags.get(i, (False, False, False))[2]
        ]

    def first_not_ready(self, name: str) -> str:
        missing = self.not_ready()
        return f"{name}-{missing[0][0] if missing else 0}"

    def line(self) -> str:
        """``"pods scheduled 2/2, running 1/2, ready 0/2"``."""
        scheduled, running, ready = self._counts
        n = self.total
        return f"pods scheduled {scheduled}/{n}, running {running}/{n}, ready {ready}/{n}"
