"""Per-rank arguments on the wire (``kt.per_rank``, ``remote.each``): the rank's side.

The caller replaces each per-rank marker by a :class:`Slot` and sends the shared message
followed by one message per rank; the call plan's ``per_rank`` field gives their offsets,
so pod 0 forwards each pod its own slices without unpickling anything, and a rank puts its
own items back where the slots are (:func:`fill`).
"""

from __future__ import annotations

from typing import Any


class Slot:
    """Where a per-rank item goes back in, on the rank (the k-th marker of the call)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (Slot, (self.index,))


def fill(
    args: tuple[Any, ...], kwargs: dict[str, Any], values: tuple[Any, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """On the rank: put its own items where the slots are."""

    def put(v: Any) -> Any:
        return values[v.index] if isinstance(v, Slot) else v

    return tuple(put(a) for a in args), {k: put(v) for k, v in kwargs.items()}


def pod_slices(per_rank: dict[str, Any], ranks: range) -> list[list[int]]:
    """The ``[offset, length]`` of each of ``ranks``' items in a per-rank call body."""
    base = int(per_rank.get("base", 0))
    items = per_rank["items"]
    return [items[r - base] for r in ranks]


def check_plan(per_rank: Any) -> dict[str, Any]:
    """Validate a call plan's ``per_rank`` field (a bad one is the caller's fault)."""
    if not isinstance(per_rank, dict):
        raise ValueError("per_rank must be an object")
    shared, items, base = per_rank.get("shared"), per_rank.get("items"), per_rank.get("base", 0)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError("per_rank.shared must be a byte count")
    if isinstance(base, bool) or not isinstance(base, int) or base < 0:
        raise ValueError("per_rank.base must be a rank")
    if not isinstance(items, list) or not all(
        isinstance(it, list)
        and len(it) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in it)
        for it in items
    ):
        raise ValueError("per_rank.items must be a list of [offset, length]")
    return {"shared": shared, "items": items, "base": base}
