"""The call tree: which pods a pod relays a call (or a launch) to.

Flat (a plan's ``tree`` 0): pod 0 sends a call to every other pod itself. A tree of fan-out
``k`` (``distribute(tree_fanout=k)``, from ``tree_minimum`` pods on): a pod relays it to at
most ``k`` children, and each child relays it on to the pods of its own subtree, so no pod
talks to more than ``k + 1`` others and a call crosses about ``log_k(N)`` hops.

A subtree is a contiguous run of the pods below its parent, in order; its first pod is the
child that relays to the rest. A subtree's ranks are then one run of the world's ranks, and a
per-rank body is cut once per child::

    split([1, 2, 3, 4, 5, 6], 2) == [[1, 2, 3], [4, 5, 6]]   # pod 1 relays to 2 and 3
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ktlite_wire.plan import CallPlan

_COMPACT = json.JSONEncoder(separators=(",", ":"))


def split(rest: list[int], fanout: int) -> list[list[int]]:
    """``rest`` (the pods below one pod, in order) as at most ``fanout`` contiguous subtrees
    of near-equal size; each one's first pod is the child that relays to the others."""
    n = len(rest)
    k = min(max(fanout, 1), n)
    out: list[list[int]] = []
    start = 0
    for j in range(k):
        size = n // k + (1 if j < n % k else 0)
        out.append(rest[start : start + size])
        start += size
    return out


def depth(pods: int, fanout: int) -> int:
    """Hops from the root to the deepest pod of a tree of ``pods`` pods (0: one pod)."""
    if pods <= 1:
        return 0
    return 1 + max(depth(len(sub), fanout) for sub in split(list(range(pods - 1)), fanout))


def relay_meta(
    plan: CallPlan, subtree: list[int], per_rank: dict[str, Any] | None
) -> dict[str, Any]:
    """The plan a child that relays to ``subtree`` (itself first) is sent: a member's, plus
    the pods of its subtree and nothing of the others (:meth:`CallPlan.window`), so what a
    relay is sent and parses grows with its subtree, not with the deployment."""
    meta = plan.member_meta(per_rank)
    meta.update(plan.window(subtree))
    return meta


def relay_header(plan: CallPlan, subtree: list[int], per_rank: dict[str, Any] | None) -> str:
    """The ``x-ktlite-call`` header of the child relaying to ``subtree``."""
    return _COMPACT.encode(relay_meta(plan, subtree, per_rank))


def subtree_body(
    plan: CallPlan, subtree: list[int], payload: Any
) -> tuple[dict[str, Any] | None, Any]:
    """What a child relaying to ``subtree`` needs of the call's body: all of it, or for a
    per-rank call the shared message and the items of the subtree's ranks (from shared
    memory: their offsets only). Returns its ``per_rank`` field and its body."""
    if plan.per_rank is None:
        return None, memoryview(b"" if plan.shm else payload).cast("B")
    inside = {r for i in subtree for r in plan.pod_ranks(i)}
    lo, hi = min(inside), max(inside) + 1
    items, base = plan.per_rank["items"], int(plan.per_rank.get("base", 0))
    shared = plan.per_rank["shared"]
    if plan.shm:  # every pod maps the same file
        at = [items[r - base] if r in inside else [0, 0] for r in range(lo, hi)]
        return {"shared": shared, "items": at, "base": lo}, memoryview(b"")
    view = memoryview(payload).cast("B")
    body, cut, pos = [view[:shared]], [], shared
    for r in range(lo, hi):  # ranks of pods outside the subtree (workers=) get no bytes
        off, n = items[r - base] if r in inside else (0, 0)
        body.append(view[off : off + n])
        cut.append([pos, n])
        pos += n
    return {"shared": shared, "items": cut, "base": lo}, body


@dataclass(frozen=True)
class LaunchRelay:
    """The ``x-ktlite-tree`` header of a code push (or a pod-table request) relayed down the
    tree: the addresses and names of the pods from ordinal ``first`` on (the caller's names
    every pod; a relay's only its subtree's, :meth:`below`), the subtree the receiving pod
    (its first pod) relays to, the fan-out, how long a child may take to accept a connection
    before it is reported, and the caller's Python.
    The body is the launch as pod 0 got it; each pod installs it with its own ordinal."""

    pods: list[str]
    names: list[str]
    subtree: list[int]
    fanout: int
    timeout: float
    python: str = ""  # the caller's Python (major.minor): a pod running another refuses
    first: int = 0  # the ordinal of pods[0]

    def __post_init__(self) -> None:
        n = len(self.pods)
        if len(self.names) != n or not all(isinstance(p, str) for p in self.pods + self.names):
            raise ValueError("pods and names must be lists of strings of the same length")
        if type(self.first) is not int or self.first < 0:
            raise ValueError(f"first={self.first!r} must be a whole number >= 0")
        lo, hi = self.first, self.first + n
        if not self.subtree or not all(type(i) is int and lo <= i < hi for i in self.subtree):
            raise ValueError(f"subtree must name pods between {lo} and {hi - 1}")
        if type(self.fanout) is not int or self.fanout < 1:
            raise ValueError(f"fanout={self.fanout!r} must be a whole number >= 1")
        if not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < 1e9:
            raise ValueError(f"timeout={self.timeout!r} must be a positive number of seconds")
        if not isinstance(self.python, str) or len(self.python) > 20:
            raise ValueError(f"python={self.python!r} must be a version such as '3.11'")

    def url(self, i: int) -> str:
        """Pod ``i``'s address (``i`` an ordinal this header names)."""
        return self.pods[i - self.first]

    def name(self, i: int) -> str:
        return self.names[i - self.first]

    def encode(self) -> str:
        # a dict of the fields, not dataclasses.asdict: that deep-copies the lists, and a
        # relay encodes one header per child
        return _COMPACT.encode(
            {
                "pods": self.pods,
                "names": self.names,
                "subtree": self.subtree,
                "fanout": self.fanout,
                "timeout": self.timeout,
                "python": self.python,
                "first": self.first,
            }
        )

    @classmethod
    def decode(cls, text: str) -> LaunchRelay:
        """Raises ValueError for a malformed header."""
        try:
            data = json.loads(text)
            return cls(**data)
        except (TypeError, RecursionError) as e:
            raise ValueError(f"malformed launch relay: {e}") from None

    def below(self, subtree: list[int], timeout: float | None = None) -> LaunchRelay:
        """The header for the child that relays to ``subtree`` (``timeout``: its own, else
        this one's): the pods from its first to its last only, so what a pod is sent and
        parses grows with its subtree, not with the deployment."""
        lo, hi = subtree[0] - self.first, subtree[-1] - self.first + 1
        return LaunchRelay(
            self.pods[lo:hi],
            self.names[lo:hi],
            subtree,
            self.fanout,
            self.timeout if timeout is None else timeout,
            self.python,
            subtree[0],
        )
