"""``BatchedDataDict`` (NeMo RL's batch type, also in ``ktlite.groups``): what NeMo's policies
and workers do with it, pure."""

from __future__ import annotations

import pytest

from ktlite.workers.batched import BatchedDataDict, SlicedDataDict


def test_shard_by_batch_size_as_nemo_documents_it() -> None:
    batch = BatchedDataDict(
        {"problem_id": [0, 0, 1, 1, 2, 2, 3, 3], "arbitrary_data": [1, 2, 3, 4, 5, 6, 7, 8]}
    )
    shards = batch.shard_by_batch_size(shards=2)
    assert all(isinstance(s, SlicedDataDict) for s in shards)
    assert [dict(s) for s in shards] == [
        {"problem_id": [0, 0, 1, 1], "arbitrary_data": [1, 2, 3, 4]},
        {"problem_id": [2, 2, 3, 3], "arbitrary_data": [5, 6, 7, 8]},
    ]
    # chunks of batch_size first: each shard starts with problems 0 and 1
    assert [s["problem_id"] for s in batch.shard_by_batch_size(shards=2, batch_size=4)] == [
        [0, 0, 2, 2],
        [1, 1, 3, 3],
    ]
    uneven = BatchedDataDict(
        {"problem_id": [0, 1, 2, 3, 4], "arbitrary_data": [10, 11, 12, 13, 14]}
    )
    assert [
        s["arbitrary_data"] for s in uneven.shard_by_batch_size(shards=2, allow_uneven_shards=True)
    ] == [
        [10, 11, 12],
        [13, 14],
    ]
    with pytest.raises(ValueError, match="does not split into 2 equal shards"):
        uneven.shard_by_batch_size(shards=2)
    with pytest.raises(ValueError, match="takes no batch_size"):
        uneven.shard_by_batch_size(shards=2, batch_size=5, allow_uneven_shards=True)
    with pytest.raises(ValueError, match="different batch sizes"):
        BatchedDataDict({"a": [1, 2], "b": [1]}).shard_by_batch_size(1)
    with pytest.raises(NotImplementedError, match="sequence_packing_args"):
        batch.shard_by_batch_size(
            2, sequence_packing_args={"algorithm": "modified_first_fit_decreasing"}
        )


def test_tensor_shards_and_from_batches_round_trip_with_padding(torch) -> None:
    batch = BatchedDataDict(
        {
            "input_ids": torch.arange(12).reshape(4, 3),
            "input_lengths": torch.tensor([3, 2, 3, 1]),
            "text": ["a", "b", "c", "d"],
        }
    )
    shards = batch.shard_by_batch_size(2)
    assert torch.equal(shards[1]["input_ids"], torch.tensor([[6, 7, 8], [9, 10, 11]]))
    joined = BatchedDataDict.from_batches(shards)
    assert torch.equal(joined["input_ids"], batch["input_ids"]) and joined["text"] == batch["text"]
    assert torch.equal(joined["input_lengths"], batch["input_lengths"])
    # workers return sequences of different lengths: padded to the longest, per key
    out = BatchedDataDict.from_batches(
        [{"logprobs": torch.ones(1, 2)}, {"logprobs": torch.ones(2, 4)}],
        pad_value_dict={"logprobs": -1.0},
    )
    assert out["logprobs"].tolist() == [[1, 1, -1, -1], [1, 1, 1, 1], [1, 1, 1, 1]]
    topk = BatchedDataDict.from_batches([{"k": torch.zeros(1, 2, 3)}, {"k": torch.zeros(2, 4, 3)}])
    assert topk["k"].shape == (3, 4, 3)
    with pytest.raises(KeyError, match="'text' is missing"):
        BatchedDataDict.from_batches([{"text": ["a"], "id": [0]}, {"id": [1]}])
    with pytest.raises(TypeError, match="a list or a tensor"):
        BatchedDataDict.from_batches([{"x": [1]}, {"x": torch.ones(1)}])


def test_slicing_selecting_reordering_and_repeating(torch) -> None:
    batch = BatchedDataDict(
        {"ids": torch.tensor([10, 11, 12, 13, 14, 15]), "meta": [{"n": i} for i in range(6)]}
    )
    assert batch.size == 6 and BatchedDataDict().size == 0
    part = batch.slice(1, 3)
    assert (
        isinstance(part, SlicedDataDict)
        and part["ids"].tolist() == [11, 12]
        and part["meta"] == [{"n": 1}, {"n": 2}]
    )
    assert batch.chunk(rank=2, chunks=3)["ids"].tolist() == [14, 15]
    assert batch.get_batch(batch_idx=1, batch_size=2)["ids"].tolist() == [12, 13]
    picked = batch.select_indices([5, 0])
    assert picked["ids"].tolist() == [15, 10] and picked["meta"] == [{"n": 5}, {"n": 0}]
    assert batch.select_indices(torch.tensor([1]))["meta"] == [{"n": 1}]
    shuffled = batch.select_indices([2, 0, 1, 5, 3, 4])
    shuffled.reorder_data([2, 0, 1, 5, 3, 4])  # item i goes back to position order[i]
    assert shuffled["ids"].tolist() == batch["ids"].tolist() and shuffled["meta"] == batch["meta"]
    repeated = batch.slice(0, 2).repeat_interleave(2)
    assert repeated["ids"].tolist() == [10, 10, 11, 11] and repeated["meta"] == [
        {"n": 0},
        {"n": 0},
        {"n": 1},
        {"n": 1},
    ]
    repeated["meta"][0]["n"] = 99  # each repeat is its own copy
    assert repeated["meta"][1] == {"n": 0}
    assert [mb["ids"].tolist() for mb in batch.make_microbatch_iterator(3)] == [
        [10, 11, 12],
        [13, 14, 15],
    ]
    with pytest.raises(ValueError, match="microbatches of 4"):
        list(batch.make_microbatch_iterator(4))
    with pytest.raises(ValueError, match="outside the batch"):
        batch.slice(4, 8)
    with pytest.raises(ValueError, match="permutation"):
        batch.reorder_data([0, 0, 1, 2, 3, 4])
    moved = batch.to_device("cpu")
    assert moved is not batch and moved["ids"].device.type == "cpu" and batch.to("cpu") is batch
    assert batch.get_dict() is batch.data


def test_dynamic_batching_plans_token_bounded_microbatches(torch) -> None:
    lengths = [4, 1, 3, 2, 2, 1, 2, 1]
    batch = BatchedDataDict(
        {
            "input_ids": torch.arange(32).reshape(8, 4),
            "input_lengths": torch.tensor(lengths),
            "row": list(range(8)),
        }
    )
    args = {
        "max_tokens_per_microbatch": 4,
        "sequence_length_round": 2,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
    }
    shards, order = batch.shard_by_batch_size(2, batch_size=4, dynamic_batching_args=args)
    # each chunk of 4 is ordered by length and dealt to the shards in turn
    assert order == [1, 2, 3, 0, 5, 4, 7, 6]
    assert [s["row"] for s in shards] == [[1, 2, 5, 4], [3, 0, 7, 6]]
    # one plan for every shard: lengths rounded to 2, at most 4 tokens per microbatch
    assert (
        shards[0].micro_batch_indices
        == shards[1].micro_batch_indices
        == [[[0, 1], [1, 2]], [[0, 2]]]
    )
    assert shards[0].micro_batch_lengths == [[2, 4], [2]]
    first = shards[0].get_batch(batch_idx=0, batch_size=2)
    assert first.get_microbatch_iterator_dynamic_shapes_len() == 2
    assert [
        mb["input_ids"].shape[1] for mb in first.make_microbatch_iterator_with_dynamic_shapes()
    ] == [2, 4]
    second = [
        mb["row"] for mb in shards[0].get_batch(1, 2).make_microbatch_iterator_with_dynamic_shapes()
    ]
    assert second == [[5, 4]]
    with pytest.raises(ValueError, match="no microbatch plan"):
        list(shards[0].make_microbatch_iterator_with_dynamic_shapes())
    # get_logprobs' form (one chunk): the controller joins what the shards return and puts
    # it back in the original order
    shards, order = batch.shard_by_batch_size(2, batch_size=None, dynamic_batching_args=args)
    joined = BatchedDataDict.from_batches(shards)
    assert joined["row"] != list(range(8))
    joined.reorder_data(order)
    assert joined["row"] == list(range(8)) and joined["input_lengths"].tolist() == lengths
    with pytest.raises(ValueError, match="does not fit max_tokens_per_microbatch=2"):
        batch.shard_by_batch_size(2, dynamic_batching_args={**args, "max_tokens_per_microbatch": 2})
