"""Per-rank arguments: ``kt.per_rank(items)`` and ``remote.each(items)``.

In one call, rank r gets ``items[r]`` where the marker stood, and only the pod of rank r
receives that item. The call's other (shared) arguments are encoded once and reach each pod
once. On the wire the body is the shared message followed by one message per rank; the call
plan's ``per_rank`` field gives their offsets, so pod 0 forwards each pod its own slices
without unpickling anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ktlite.errors import ConfigError
from ktlite_wire.rankdata import Slot


class PerRank:
    """A marker: one item per rank, in rank order (``len(items)`` must be the world size)."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Any]) -> None:
        if (
            isinstance(items, (str, bytes, dict))
            or not hasattr(items, "__len__")
            or not hasattr(items, "__getitem__")
        ):
            raise ConfigError(
                f"kt.per_rank() needs a list with one item per rank, got {type(items).__name__}"
            )
        self.items = items

    def __repr__(self) -> str:
        return f"kt.per_rank(<{len(self.items)} items>)"


def per_rank(items: Sequence[Any]) -> PerRank:
    """Mark an argument as one item per rank: ``remote(batch=kt.per_rank(shards), lr=0.1)``
    gives rank r ``batch=shards[r]``; only rank r's pod receives ``shards[r]``."""
    return PerRank(items)


def split(
    args: tuple[Any, ...], kwargs: dict[str, Any], world: int
) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[Any, ...]] | None]:
    """Replace top-level PerRank markers by slots; the per-rank values, one tuple per rank
    (None when the call has no marker). A wrong length is a ConfigError, before anything
    is sent."""
    markers: list[PerRank] = []

    def slot(value: Any, where: str) -> Any:
        if not isinstance(value, PerRank):
            return value
        if len(value.items) != world:
            raise ConfigError(
                f"{where}: kt.per_rank() got {len(value.items)} item(s) for {world} rank(s); give "
                "exactly one item per rank, in rank order"
            )
        markers.append(value)
        return Slot(len(markers) - 1)

    new_args = tuple(slot(a, f"argument {i}") for i, a in enumerate(args))
    new_kwargs = {k: slot(v, f"argument {k!r}") for k, v in kwargs.items()}
    if not markers:
        return args, kwargs, None
    return new_args, new_kwargs, [tuple(m.items[r] for m in markers) for r in range(world)]
