"""``BatchedDataDict``: NeMo RL's batch of named columns, as its policies and workers use it.

A dict of columns that share one batch dimension: each value is a list (one item per
sample) or a tensor whose first dimension is the batch. The controller splits a batch for
the data-parallel workers (:meth:`BatchedDataDict.shard_by_batch_size`), the workers cut
their shard into microbatches, and the controller joins what they return
(:meth:`BatchedDataDict.from_batches`).

torch is imported only where a tensor is handled (a tensor cannot exist without it), so
batches of lists work without torch.
"""

from __future__ import annotations

import sys
from collections import UserDict
from collections.abc import Iterator, Mapping, Sequence
from copy import deepcopy
from typing import Any, Generic, TypedDict, TypeVar

T = TypeVar("T")


class DynamicBatchingArgs(TypedDict):
    """How :meth:`BatchedDataDict.shard_by_batch_size` forms token-bounded microbatches."""

    max_tokens_per_microbatch: int  # samples x padded length of a microbatch stays within this
    sequence_length_round: int  # lengths are rounded up to a multiple of this
    input_key: str  # the column of token ids (batch x sequence)
    input_lengths_key: str  # the column of each sample's length


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_tensor(value)


def _rows(value: Any) -> int:
    return int(value.shape[0]) if _is_tensor(value) else len(value)


def _take(value: Any, indices: Sequence[int]) -> Any:
    if _is_tensor(value):
        import torch

        return value.index_select(
            0, torch.as_tensor(list(indices), dtype=torch.long, device=value.device)
        )
    return [value[i] for i in indices]


def _cat(key: str, parts: list[Any], pad_value: float) -> Any:
    """One column from the same column of several batches."""
    if all(isinstance(p, list) for p in parts):
        return [item for part in parts for item in part]
    if not all(_is_tensor(p) for p in parts):
        kinds = sorted({type(p).__name__ for p in parts})
        raise TypeError(
            f"column {key!r} holds {', '.join(kinds)}: a column is a list or a tensor in every batch"
        )
    import torch

    if all(p.ndim == 1 for p in parts):
        return torch.cat(parts)
    if parts[0].ndim == 2:  # batch x sequence: pad each row to the longest
        rows = [row for part in parts for row in part]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_value)
    longest = max(p.shape[1] for p in parts)  # batch x sequence x ...: pad dimension 1
    padded = [
        torch.nn.functional.pad(
            p, (0, 0) * (p.ndim - 2) + (0, longest - p.shape[1]), value=pad_value
        )
        for p in parts
    ]
    return torch.cat(padded)


class BatchedDataDict(UserDict, Generic[T]):  # type: ignore[type-arg]
    """Named columns over one batch dimension (NeMo RL's ``BatchedDataDict``).

    Examples:
        >>> batch = BatchedDataDict({"prompt": ["a", "b", "c", "d"], "id": [0, 1, 2, 3]})
        >>> [s["id"] for s in batch.shard_by_batch_size(2)]
        [[0, 1], [2, 3]]
        >>> BatchedDataDict.from_batches(batch.shard_by_batch_size(2))["id"]
        [0, 1, 2, 3]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # set by shard_by_batch_size with dynamic batching: per chunk, the [start, end) of each
        # microbatch and its padded length
        self.micro_batch_indices: list[list[list[int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.elem_counts_per_gb: list[int] | None = None

    # ---- joining and splitting -----------------------------------------------------------

    @classmethod
    def from_batches(
        cls, batches: Sequence[Mapping[Any, Any]], pad_value_dict: dict[str, float] | None = None
    ) -> Any:
        """Stack batches into one, in order: lists are concatenated, 1-D tensors too, and
        sequence tensors are padded to the longest (with 0, or ``pad_value_dict[key]``)."""
        out = cls()
        pads = pad_value_dict or {}
        for key in sorted({k for b in batches for k in b}, key=str):
            missing = [
                i
                for i, b in enumerate(batches)
                if key not in b and b and _rows(next(iter(b.values())))
            ]
            if missing:
                raise KeyError(f"column {key!r} is missing from non-empty batch(es) {missing}")
            out[key] = _cat(key, [b[key] for b in batches if key in b], pads.get(key, 0))
        return out

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: Any = None,
    ) -> Any:
        """Split into ``shards`` parts for data-parallel workers.

        The batch is cut into chunks of ``batch_size`` (the whole batch by default); shard s
        takes the s-th equal part of every chunk, so each shard's first microbatches come
        from the first chunk. ``allow_uneven_shards`` (without ``batch_size``) lets the last
        shards be shorter. With ``dynamic_batching_args``, each chunk is first ordered by
        sample length and dealt round-robin to the shards, every shard gets the same
        token-bounded microbatches (``micro_batch_indices``), and the return value is
        ``(shards, sorted_indices)``: ``result.reorder_data(sorted_indices)`` restores the
        original order of what the shards return.
        """
        if sequence_packing_args is not None:
            raise NotImplementedError(
                "shard_by_batch_size(sequence_packing_args=...) is not in ktlite's BatchedDataDict: "
                "use dynamic_batching_args (token-bounded microbatches) or plain shards"
            )
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards={shards!r} must be a whole number >= 1")
        if allow_uneven_shards and batch_size is not None:
            raise ValueError(
                "allow_uneven_shards=True takes no batch_size: the whole batch is one chunk"
            )
        if allow_uneven_shards and dynamic_batching_args is not None:
            raise ValueError(
                "allow_uneven_shards=True and dynamic_batching_args cannot be combined"
            )
        total = self._batch_size()
        batch_size = total if batch_size is None else batch_size
        if batch_size < 1 or total % batch_size:
            raise ValueError(
                f"the batch ({total} samples) is not a whole number of chunks of batch_size={batch_size}"
            )
        if not allow_uneven_shards and batch_size % shards:
            raise ValueError(
                f"batch_size {batch_size} does not split into {shards} equal shards; pad the batch to a "
                f"multiple of {shards} or pass allow_uneven_shards=True"
            )
        chunks = total // batch_size
        per_shard = -(-batch_size // shards)
        order = list(range(total))
        if dynamic_batching_args is not None:
            lengths = [int(x) for x in self.data[dynamic_batching_args["input_lengths_key"]]]
            order = []
            for c in range(chunks):
                by_length = sorted(
                    range(c * batch_size, (c + 1) * batch_size), key=lambda i: lengths[i]
                )
                order += [i for s in range(shards) for i in by_length[s::shards]]
        out = []
        for s in range(shards):
            picked = [
                order[i]
                for c in range(chunks)
                for i in range(
                    c * batch_size + s * per_shard, min(c * batch_size + (s + 1) * per_shard, total)
                )
            ]
            out.append(SlicedDataDict({k: _take(v, picked) for k, v in self.data.items()}))
        if dynamic_batching_args is None:
            return out
        _plan_microbatches(
            out,
            chunks,
            per_shard,
            self.data[dynamic_batching_args["input_key"]].shape[1],
            dynamic_batching_args,
        )
        return out, order

    def chunk(self, rank: int, chunks: int) -> SlicedDataDict:
        """The ``rank``-th of ``chunks`` equal consecutive parts."""
        total = self._batch_size()
        if total % chunks:
            raise ValueError(
                f"the batch ({total} samples) does not split into {chunks} equal chunks"
            )
        if not 0 <= rank < chunks:
            raise ValueError(f"rank={rank} is not between 0 and {chunks - 1}")
        return self.slice(rank * total // chunks, (rank + 1) * total // chunks)

    def slice(self, start: int, end: int) -> SlicedDataDict:
        """Samples ``start`` to ``end`` (exclusive)."""
        total = self._batch_size()
        if not 0 <= start <= end <= total:
            raise ValueError(f"slice({start}, {end}) is outside the batch of {total} samples")
        return SlicedDataDict({k: v[start:end] for k, v in self.data.items()})

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> SlicedDataDict:
        """The ``batch_idx``-th global batch of ``batch_size`` samples, with its microbatch plan."""
        if self.elem_counts_per_gb is not None:
            start = sum(self.elem_counts_per_gb[:batch_idx])
            batch = self.slice(start, start + self.elem_counts_per_gb[batch_idx])
            batch.elem_counts_per_gb = [self.elem_counts_per_gb[batch_idx]]
        else:
            if batch_size is None:
                raise ValueError(
                    "get_batch() needs batch_size= (this batch has no per-batch counts)"
                )
            batch = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None and self.micro_batch_lengths is not None:
            batch.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            batch.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
        return batch

    def select_indices(self, indices: Sequence[int] | Any) -> Any:
        """A new batch of the samples at ``indices``, in that order."""
        picked = indices.tolist() if hasattr(indices, "tolist") else list(indices)
        return type(self)({k: _take(v, picked) for k, v in self.data.items()})

    def reorder_data(self, reorded_indices: Sequence[int]) -> None:
        """In place: sample i moves to position ``reorded_indices[i]`` (undoes the order that
        dynamic batching returned)."""
        total = self._batch_size()
        if sorted(int(i) for i in reorded_indices) != list(range(total)):
            raise ValueError(f"reorder_data needs a permutation of 0..{total - 1}")
        inverse = [0] * total
        for i, target in enumerate(reorded_indices):
            inverse[int(target)] = i
        for k, v in list(self.data.items()):
            self.data[k] = _take(v, inverse)

    def repeat_interleave(self, num_repeats: int) -> Any:
        """Each sample ``num_repeats`` times in a row (list items are copied, not shared)."""
        out = type(self)()
        for k, v in self.data.items():
            if _is_tensor(v):
                out[k] = v.repeat_interleave(num_repeats, dim=0)
            else:
                out[k] = [deepcopy(item) for item in v for _ in range(num_repeats)]
        return out

    # ---- microbatches --------------------------------------------------------------------

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[SlicedDataDict]:
        """Consecutive microbatches of ``microbatch_size`` samples."""
        total = self.size
        if microbatch_size < 1 or total % microbatch_size:
            raise ValueError(
                f"the batch ({total} samples) is not a whole number of microbatches of {microbatch_size}"
            )
        for start in range(0, total, microbatch_size):
            yield self.slice(start, start + microbatch_size)

    def make_microbatch_iterator_with_dynamic_shapes(
        self, sequence_dim: int = 1
    ) -> Iterator[SlicedDataDict]:
        """The microbatches dynamic batching planned for this (one global batch's) shard, each
        cut to its padded length along ``sequence_dim``."""
        indices, lengths = self._one_plan()
        for (start, end), length in zip(indices, lengths, strict=True):
            mb = self.slice(start, end)
            mb.truncate_tensors(dim=sequence_dim, truncated_len=length)
            yield mb

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        return len(self._one_plan()[0])

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """In place: tensors with a dimension ``dim`` keep its first ``truncated_len`` entries."""
        for k, v in list(self.data.items()):
            if _is_tensor(v) and v.ndim > dim:
                self.data[k] = v.narrow(dim, 0, min(truncated_len, v.shape[dim]))

    # ---- the rest ------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The batch size (of the first column; 0 when empty)."""
        return _rows(next(iter(self.data.values()))) if self.data else 0

    def to(self, device: Any) -> Any:
        """In place: every tensor moved to ``device``; returns the batch."""
        for k, v in list(self.data.items()):
            if _is_tensor(v):
                self.data[k] = v.to(device)
        return self

    def to_device(self, device: Any) -> Any:
        """A new batch with every tensor on ``device``."""
        return type(self)(dict(self.data)).to(device)

    def get_dict(self) -> dict[Any, Any]:
        return self.data

    def _batch_size(self) -> int:
        sizes = {k: _rows(v) for k, v in self.data.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the columns have different batch sizes: {sizes}")
        return next(iter(sizes.values()), 0)

    def _one_plan(self) -> tuple[list[list[int]], list[int]]:
        if (
            self.micro_batch_indices is None
            or self.micro_batch_lengths is None
            or len(self.micro_batch_indices) != 1
        ):
            raise ValueError(
                "this batch has no microbatch plan for one global batch: shard with "
                "dynamic_batching_args, then take one global batch with get_batch()"
            )
        return self.micro_batch_indices[0], self.micro_batch_lengths[0]


class SlicedDataDict(BatchedDataDict):  # type: ignore[type-arg]
    """A part of a larger batch (a shard, a slice): the type says so, nothing else differs."""


def _plan_microbatches(
    shards: list[SlicedDataDict],
    chunks: int,
    per_shard: int,
    full_length: int,
    args: DynamicBatchingArgs,
) -> None:
    """Give every shard the same microbatch plan: within each chunk, consecutive samples join
    a microbatch while (samples x the longest padded length among all shards at those
    positions) stays within ``max_tokens_per_microbatch``."""
    limit, step = args["max_tokens_per_microbatch"], args["sequence_length_round"]
    lengths = [[int(x) for x in shard[args["input_lengths_key"]]] for shard in shards]
    all_indices, all_lengths = [], []
    for c in range(chunks):
        indices: list[list[int]] = []
        padded: list[int] = []
        for i in range(per_shard):
            longest = max(ls[c * per_shard + i] for ls in lengths)
            need = min(-(-longest // step) * step, full_length)
            if need > limit:
                raise ValueError(
                    f"a sample of padded length {need} does not fit max_tokens_per_microbatch={limit}"
                )
            if indices and (i - indices[-1][0] + 1) * max(padded[-1], need) <= limit:
                indices[-1][1] = i + 1
                padded[-1] = max(padded[-1], need)
            else:
                indices.append([i, i + 1])
                padded.append(need)
        all_indices.append(indices)
        all_lengths.append(padded)
    for shard in shards:
        shard.micro_batch_indices = deepcopy(all_indices)
        shard.micro_batch_lengths = list(map(list, all_lengths))
