"""The planner's model states count the attention biases: exact against a built model's parameters."""

from __future__ import annotations

import pytest

from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_chunk
from modelpar.parallel.layout import ParallelLayout
from modelpar.plan import Strategy
from modelpar.plan.chunks import strategy_partition
from modelpar.plan.spec import ModelSpec
from modelpar.plan.states import stage_units


@pytest.mark.parametrize("out_bias", [False, True], ids=["qkv", "qkv-and-o"])
def test_planner_states_of_a_biased_model_equal_the_built_chunks_parameters(out_bias):
    config = ModelConfig(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=48, attention_bias=True,
        attention_out_bias=out_bias,
    )  # fmt: skip
    model = ModelSpec(config)
    strategy = Strategy(ParallelLayout(pp=2), 1, 2, "none", 0, False)
    partition = strategy_partition(model, strategy, 16)
    for stage in range(2):
        (c,) = partition.chunks_of(stage)
        chunk = build_chunk(
            config, None, partition.layers(c), first=partition.has_embedding(c), last=partition.has_head(c), seed=0
        )
        built = sum(p.numel() for p in chunk.parameters())
        units = stage_units(model, strategy, 16, stage)
        planned = sum(rows * cols * count for _, tensors, count in units for rows, cols in tensors)
        assert planned == built, f"stage {stage}"
        plain = sum(p.numel() for n, p in chunk.named_parameters() if not n.endswith("bias"))
        assert built - plain == len(partition.layers(c)) * ((4 + 2 * 2) * 8 + 32 * out_bias)
