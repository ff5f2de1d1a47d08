"""Named-axis sharding (NeMo's ``run_all_workers_sharded_data``): the pure maths.

:class:`Layout` is a named-axis view of the world (``{"dp": 2, "tp": 2}``, the first axis
outermost): data is sharded along some axes and replicated along the others.
``remote.sharded(...)`` turns that into a per-rank call (``kt.per_rank``) and keeps one
result per shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ktlite.errors import ConfigError


class Layout:
    """Named axes over the ranks, first axis outermost: ``Layout({"dp": 2, "tp": 2})`` puts
    rank 3 at ``{"dp": 1, "tp": 1}`` and rank 1 at ``{"dp": 0, "tp": 1}``."""

    def __init__(self, axes: dict[str, int]) -> None:
        if not isinstance(axes, dict) or not axes:
            raise ConfigError(f"layout={axes!r} must be a non-empty dict of axis name -> size")
        for name, size in axes.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"layout axis {name!r} must be a non-empty string")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"layout axis {name!r} has size {size!r}; sizes are whole numbers >= 1")
        self.axes = dict(axes)
        self.names = list(axes)
        self.size = math.prod(axes.values())

    def coords(self, rank: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in reversed(self.names):
            rank, out[name] = divmod(rank, self.axes[name])
        return {n: out[n] for n in self.names}

    def rank(self, coords: dict[str, int]) -> int:
        r = 0
        for name in self.names:
            r = r * self.axes[name] + coords[name]
        return r

    def check_axes(self, sharded: Sequence[str], replicated: Sequence[str]) -> None:
        both = list(sharded) + list(replicated)
        unknown = [a for a in both if a not in self.axes]
        if unknown:
            raise ConfigError(f"axis(es) {', '.join(map(repr, unknown))} not in layout {self.axes}")
        if len(set(both)) != len(both):
            raise ConfigError(f"an axis is both sharded and replicated, or named twice: "
                              f"in_sharded_axes={list(sharded)}, replicate_on_axes={list(replicated)}")
        missing = [a for a in self.names if a not in both]
        if missing:
            raise ConfigError(f"layout axis(es) {', '.join(map(repr, missing))} are neither in "
                              "in_sharded_axes nor in replicate_on_axes")

    def shard_index(self, rank: int, sharded: Sequence[str]) -> int:
        """Which shard rank ``rank`` gets: its coordinates on the sharded axes, row-major in
        the order of ``sharded``."""
        c = self.coords(rank)
        i = 0
        for a in sharded:
            i = i * self.axes[a] + c[a]
        return i

    def num_shards(self, sharded: Sequence[str]) -> int:
        return math.prod(self.axes[a] for a in sharded)

    def leaders(self, sharded: Sequence[str], replicated: Sequence[str]) -> list[int]:
        """One rank per shard, in shard order: the first rank of its replicated group
        (coordinate 0 on every replicated axis)."""
        out = [-1] * self.num_shards(sharded)
        for r in range(self.size):
            c = self.coords(r)
            if all(c[a] == 0 for a in replicated):
                out[self.shard_index(r, sharded)] = r
        return out


def flatten_shards(data: Any, layout: Layout, sharded: Sequence[str]) -> list[Any]:
    """NeMo's sharded data: a list along the first sharded axis, of lists along the next, and
    so on; returned flat, row-major. Each level's length must match its axis."""
    def walk(value: Any, depth: int, where: str) -> list[Any]:
        if depth == len(sharded):
            return [value]
        axis = sharded[depth]
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
            raise ConfigError(f"data{where} must be a list of {layout.axes[axis]} shard(s) along axis "
                              f"{axis!r}, got {type(value).__name__}")
        if len(value) != layout.axes[axis]:
            raise ConfigError(f"data{where} has {len(value)} shard(s) along axis {axis!r}, "
                              f"which has size {layout.axes[axis]}")
        return [x for i, v in enumerate(value) for x in walk(v, depth + 1, f"{where}[{i}]")]
    return walk(data, 0, "")
