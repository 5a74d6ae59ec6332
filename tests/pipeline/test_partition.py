"""Layers -> model chunks -> ranks."""

from __future__ import annotations

import pytest
from torch import nn

from modelpar.pipeline.partition import (
    PartitionError,
    parameter_counts,
    partition_by_cost,
    partition_explicit,
    partition_uniform,
)


@pytest.mark.parametrize(
    "n_layers, pp, vpp, counts",
    [(8, 2, 1, (4, 4)), (8, 3, 1, (3, 3, 2)), (7, 4, 1, (2, 2, 2, 1)), (10, 2, 2, (2, 3, 3, 2)), (5, 5, 1, (1,) * 5)],
)
def test_uniform_split_gives_spare_layers_to_middle_chunks_first(n_layers, pp, vpp, counts):
    assert partition_uniform(n_layers, pp, vpp).layer_counts == counts


def test_interleaved_chunk_c_lives_on_rank_c_mod_pp_as_local_chunk_c_div_pp():
    part = partition_uniform(8, 2, vpp=2)
    assert [list(part.layers(c)) for c in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [(part.rank_of(c), part.local_index(c)) for c in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert part.chunks_of(0) == [0, 2] and part.chunks_of(1) == [1, 3]
    assert part.has_embedding(0) and not part.has_embedding(2)
    assert part.has_head(3) and not part.has_head(1)


def test_cost_split_balances_heavy_ends():
    assert partition_by_cost([5, 1, 1, 1, 1, 5], 3).layer_counts == (1, 4, 1)


def test_cost_split_counts_the_head_on_the_last_chunk():
    assert partition_by_cost([1] * 8, 2, 2, head_cost=2).layer_counts == (2, 2, 3, 1)


def test_parameter_counts_are_per_block():
    assert parameter_counts([nn.Linear(3, 2), nn.Linear(2, 2, bias=False)]) == [8, 4]


def test_explicit_counts_are_kept():
    assert partition_explicit([3, 1, 0, 4], 8, 2, 2).layer_counts == (3, 1, 0, 4)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: partition_uniform(3, 2, 2), "pp*vpp=4 chunks exceed the 3 layers"),
        (lambda: partition_explicit([1, 2], 4, 2), "sum to 3, not the model's 4 layers; e.g. [2, 2]"),
        (lambda: partition_explicit([1, 2, 1], 4, 2), "have 3 entries but pp*vpp=2"),
        (lambda: partition_explicit([5, -1], 4, 2), "numbers >= 0"),
        (lambda: partition_by_cost([1, 1], 3), "pp*vpp=3 chunks exceed the 2 layers"),
        (lambda: partition_uniform(8, 0), "pp=0 must be a positive integer"),
        (lambda: partition_explicit([2.25, 1.75], 4, 2), "must be whole or half numbers >= 0, e.g. 4 or 4.5"),
        (lambda: partition_by_cost([1, 1, 1], 2, halves=True), "3 half-block costs: give two per layer"),
        (lambda: partition_by_cost([1, 1], 3, halves=True), "pp*vpp=3 chunks exceed the 2 half blocks"),
    ],
)
def test_impossible_splits_are_rejected_in_one_line(call, fragment):
    with pytest.raises(PartitionError) as info:
        call()
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_flops_partition_moves_a_block_off_the_head_stage_of_bench_tiny():
    from modelpar.training.build import build_partition
    from modelpar.training.config import ModelConfig, ParallelConfig, TrainConfig

    bench_tiny = ModelConfig(vocab_size=4096, hidden=256, layers=8, heads=8, kv_heads=8, ffn_hidden=688)
    counts = {}
    for pp, vpp in ((2, 1), (4, 1), (2, 2)):
        parallel = ParallelConfig(pp=pp, vpp=vpp, partition="flops", schedule="interleaved" if vpp > 1 else "1f1b")
        counts[pp, vpp] = build_partition(TrainConfig(model=bench_tiny, parallel=parallel)).layer_counts
    # attention ~ 2.0 MFLOP per token, MLP ~ 3.2, the head + loss ~ 6.3: the last chunk gets fewer blocks,
    # never none, and the cut may fall between a block's halves
    assert counts[2, 1] == (4.5, 3.5)
    assert counts[4, 1] == counts[2, 2] == (2, 2.5, 2.5, 1)
    for pp, vpp in ((2, 1), (4, 1)):
        parallel = ParallelConfig(pp=pp, vpp=vpp, partition="blocks")
        counts[pp, vpp] = build_partition(TrainConfig(model=bench_tiny, parallel=parallel)).layer_counts
    assert counts[2, 1] == (5, 3) and counts[4, 1] == (2, 2, 3, 1)  # whole blocks only
    uniform = ParallelConfig(pp=2, partition="uniform")
    assert build_partition(TrainConfig(model=bench_tiny, parallel=uniform)).layer_counts == (4, 4)


def test_half_counts_cut_between_a_blocks_attention_and_mlp():
    part = partition_explicit([4.5, 3.5], 8, 2)
    assert [list(part.layers(c)) for c in range(2)] == [[0, 1, 2, 3, 4], [4, 5, 6, 7]]
    assert part.split_blocks(0) == {4: "attention"} and part.split_blocks(1) == {4: "mlp"}
    assert part.half_range(0) == (0, 9) and part.half_range(1) == (9, 16)
    part = partition_explicit([0.5, 1, 0, 1.5], 3, 2, 2)
    assert [list(part.layers(c)) for c in range(4)] == [[0], [0, 1], [], [1, 2]]
    assert [part.split_blocks(c) for c in range(4)] == [{0: "attention"}, {0: "mlp", 1: "attention"}, {}, {1: "mlp"}]
    assert part.n_layers == 3


def test_cost_split_in_halves_cuts_inside_a_block_when_that_balances_better():
    # blocks of attention 1 + MLP 2, head 0.5: whole blocks give 6 | 3.5, halves 4 | 5.5
    assert partition_by_cost([3, 3, 3], 2, head_cost=0.5).layer_counts == (2, 1)
    assert partition_by_cost([1, 2] * 3, 2, head_cost=0.5, halves=True).layer_counts == (1.5, 1.5)
