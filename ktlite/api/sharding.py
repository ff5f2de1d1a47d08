"""Named-axis sharding (NeMo's ``run_all_workers_sharded_data``): the pure maths.

:class:`Layout` is a named-axis view of the world (``{"dp": 2, "tp": 2}``, the first axis
outermost): data is sharded along some axes and replicated along the others.
``remote.sharded(...)`` turns that into a per-rank call (``kt.per_rank``) and keeps one
result per shard.
"""

from __future__ import annotations

import math
from collections import Counter
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
                raise ConfigError(
                    f"layout axis {name!r} has size {size!r}; sizes are whole numbers >= 1"
                )
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
            raise ConfigError(
                f"an axis is both sharded and replicated, or named twice: "
                f"in_sharded_axes={list(sharded)}, replicate_on_axes={list(replicated)}"
            )
        missing = [a for a in self.names if a not in both]
        if missing:
            raise ConfigError(
                f"layout axis(es) {', '.join(map(repr, missing))} are neither in "
                "in_sharded_axes nor in replicate_on_axes"
            )

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
            raise ConfigError(
                f"data{where} must be a list of {layout.axes[axis]} shard(s) along axis "
                f"{axis!r}, got {type(value).__name__}"
            )
        if len(value) != layout.axes[axis]:
            raise ConfigError(
                f"data{where} has {len(value)} shard(s) along axis {axis!r}, "
                f"which has size {layout.axes[axis]}"
            )
        return [x for i, v in enumerate(value) for x in walk(v, depth + 1, f"{where}[{i}]")]

    return walk(data, 0, "")


def _grid(layout: Any) -> tuple[list[int], list[int]]:
    """A nested list (or anything with ``tolist()``, e.g. a numpy array) of rank ids: its
    shape and its ids, row-major."""
    if hasattr(layout, "tolist"):
        layout = layout.tolist()
    if isinstance(layout, int) and not isinstance(layout, bool):
        return [], [layout]
    if isinstance(layout, (str, bytes, dict)) or not isinstance(layout, Sequence) or not layout:
        raise ConfigError(
            f"NamedSharding layout {layout!r} must be a non-empty nested list of rank ids, "
            "e.g. [[0, 1], [2, 3]]"
        )
    parts = [_grid(x) for x in layout]
    shapes = {tuple(shape) for shape, _ in parts}
    if len(shapes) != 1:
        raise ConfigError(
            f"NamedSharding layout {layout!r} is ragged: every row must have the same shape"
        )
    return [len(parts), *parts[0][0]], [r for _, ids in parts for r in ids]


class NamedSharding:
    """NeMo RL's named rank layout: an N-dimensional grid of worker (rank) ids with one name
    per dimension, outermost first.

    ``NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])`` puts rank 2 at ``{"dp": 1, "tp": 0}``.
    A worker group given one (``sharding_annotations=``) uses it for
    ``run_rank_0_only_axes`` and ``run_all_workers_sharded_data``. The layout may be a
    nested list or a numpy array (``np.arange(8).reshape(2, 2, 2)``).
    """

    def __init__(self, layout: Any, names: Sequence[str]) -> None:
        shape, ids = _grid(layout)
        if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(
                f"NamedSharding names={names!r} must be a list of axis names, e.g. ['dp', 'tp']"
            )
        if len(names) != len(shape):
            raise ConfigError(
                f"NamedSharding layout has {len(shape)} dimension(s) {tuple(shape)} but "
                f"{len(names)} name(s) {list(names)}: give one name per dimension"
            )
        if len(set(names)) != len(names):
            raise ConfigError(f"NamedSharding names={list(names)} repeat an axis name")
        bad = [r for r in ids if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if bad:
            raise ConfigError(
                f"NamedSharding layout holds {bad[:3]}: rank ids are whole numbers >= 0"
            )
        twice = sorted(r for r, n in Counter(ids).items() if n > 1)
        if twice:
            raise ConfigError(f"NamedSharding layout lists rank(s) {twice} more than once")
        self._names = list(names)
        self._shape = shape
        self._ids = ids
        self._where = {r: i for i, r in enumerate(ids)}

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self._names, self._shape, strict=True))

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return len(self._ids)

    @property
    def layout(self) -> list[Any]:
        """The grid as a nested list."""

        def build(depth: int, offset: int) -> Any:
            if depth == self.ndim:
                return self._ids[offset]
            step = math.prod(self._shape[depth + 1 :])
            return [build(depth + 1, offset + i * step) for i in range(self._shape[depth])]

        nested: list[Any] = build(0, 0)
        return nested

    def get_axis_index(self, name: str) -> int:
        self._check_axis(name)
        return self._names.index(name)

    def get_axis_size(self, name: str) -> int:
        self._check_axis(name)
        return self._shape[self._names.index(name)]

    def get_worker_coords(self, worker_id: int) -> dict[str, int]:
        """Where worker ``worker_id`` sits: ``{axis name: coordinate}``."""
        if worker_id not in self._where:
            raise ConfigError(
                f"worker {worker_id!r} is not in this layout (ranks {sorted(self._where)})"
            )
        flat, out = self._where[worker_id], {}
        for name, size in reversed(list(zip(self._names, self._shape, strict=True))):
            flat, out[name] = divmod(flat, size)
        return {n: out[n] for n in self._names}

    def get_ranks_by_coord(self, **coords: int) -> list[int]:
        """The ranks at these coordinates (axes not named match every coordinate), sorted;
        an out-of-range coordinate matches nothing."""
        for name in coords:
            self._check_axis(name)
        return sorted(
            r
            for r in self._ids
            if all(self.get_worker_coords(r)[a] == c for a, c in coords.items())
        )

    def get_ranks(self, **coords: int) -> NamedSharding | int:
        """The sub-layout at these coordinates, over the axes not named; the rank itself when
        every axis is named."""
        for name, index in coords.items():
            size = self.get_axis_size(name)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
                raise IndexError(
                    f"index {index!r} is out of range for axis {name!r} of size {size}"
                )
        rest = [n for n in self._names if n not in coords]
        ranks = [
            r
            for r in self._ids
            if all(self.get_worker_coords(r)[a] == c for a, c in coords.items())
        ]
        if not rest:
            return ranks[0]
        shape = [self.get_axis_size(n) for n in rest]

        def nest(ids: list[int], dims: list[int]) -> Any:
            if len(dims) == 1:
                return ids
            step = len(ids) // dims[0]
            return [nest(ids[i * step : (i + 1) * step], dims[1:]) for i in range(dims[0])]

        return NamedSharding(nest(ranks, shape), rest)

    @staticmethod
    def is_axis_zero(coords: dict[str, int], axes: Sequence[str]) -> bool:
        """True when ``coords`` is 0 on every one of ``axes`` (an axis not in ``coords`` counts
        as 0)."""
        return all(coords.get(a, 0) == 0 for a in axes)

    def _check_axis(self, name: str) -> None:
        if name not in self._names:
            raise ConfigError(f"axis {name!r} is not in this layout; its axes are {self._names}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return (self._names, self._shape, self._ids) == (other._names, other._shape, other._ids)

    def __hash__(self) -> int:
        return hash((tuple(self._names), tuple(self._shape), tuple(self._ids)))

    def __repr__(self) -> str:
        return (
            f"NamedSharding(shape={tuple(self._shape)}, names={self._names}, layout={self.layout})"
        )


def row_major(axes: dict[str, int]) -> NamedSharding:
    """A ``{"dp": 2, "tp": 2}`` layout (ktlite's form) as a NamedSharding: ranks in order,
    the first axis outermost."""
    lay = Layout(axes)

    def nest(offset: int, depth: int) -> Any:
        if depth == len(lay.names):
            return offset
        step = math.prod(lay.axes[n] for n in lay.names[depth + 1 :])
        return [nest(offset + i * step, depth + 1) for i in range(lay.axes[lay.names[depth]])]

    return NamedSharding(nest(0, 0), lay.names)


def check_layout(sharding: Any, world: int) -> Any:
    """A worker group's ``sharding_annotations``: a NamedSharding (ktlite's or NeMo's) over
    exactly its ``world`` workers; None stays None."""
    if sharding is None:
        return None
    if not all(
        hasattr(sharding, a) for a in ("names", "size", "get_worker_coords", "get_axis_size")
    ):
        raise ConfigError(
            f"sharding_annotations={sharding!r} must be a NamedSharding(layout, names) "
            "(from ktlite.groups or NeMo's named_sharding)"
        )

    def laid_out(worker: int) -> bool:
        try:
            sharding.get_worker_coords(worker)
        except ValueError:
            return False
        return True

    if int(sharding.size) != world or not all(laid_out(w) for w in range(world)):
        raise ConfigError(
            f"sharding_annotations {sharding!r} must lay out exactly the group's {world} workers "
            f"(ranks 0..{world - 1})"
        )
    return sharding
