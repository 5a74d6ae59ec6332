"""modelpar-eval takes the model from the checkpoint: every identity field, the MoE section's too; a field the
command line sets that differs is named with what set it (a field override or the model group's choice)."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest

from modelpar.cli.eval import model_of_checkpoint
from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.training.config import RecipeError, TrainConfig

CKPT = Path("runs/x/checkpoints/step-00000010")
MOE = ModelConfig(name="mixtral-tiny", hidden=48, ffn_hidden=80, moe=MoEConfig(experts=4, top_k=2, ffn_hidden=40))


def test_a_moe_checkpoint_needs_no_model_overrides():
    got = model_of_checkpoint(TrainConfig(), asdict(MOE), {}, CKPT)
    assert got.identity() == MOE.identity()
    assert got.moe.experts == 4 and got.moe.ffn_hidden == 40


def test_experts_on_a_dense_checkpoint_are_one_line_naming_the_override():
    cfg = TrainConfig(model=ModelConfig(moe=MoEConfig(experts=4)))
    with pytest.raises(RecipeError) as err:
        model_of_checkpoint(cfg, asdict(ModelConfig()), {"model.moe.experts": "4"}, CKPT)
    assert "moe.experts=0" in str(err.value) and "model.moe.experts=4" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_model_group_choice_is_named_with_every_field_it_changes():
    bench = replace(ModelConfig(), hidden=128, ffn_hidden=688)
    with pytest.raises(RecipeError) as err:
        model_of_checkpoint(TrainConfig(model=bench), asdict(ModelConfig()), {"model": "bench-tiny"}, CKPT)
    message = str(err.value)
    assert "hidden=64" in message and "ffn_hidden=176" in message
    assert "but model=bench-tiny gives hidden=128, ffn_hidden=688;" in message
    assert "drop model=bench-tiny " in message


def test_a_qwen3_checkpoint_brings_its_head_dim_and_qk_norm_and_an_older_one_means_neither():
    qwen3 = ModelConfig(hidden=48, heads=4, head_dim=16, qk_norm=True, moe=MoEConfig(experts=4, norm_topk_prob=False))
    got = model_of_checkpoint(TrainConfig(), asdict(qwen3), {}, CKPT)
    assert (got.head_size, got.qk_norm, got.moe.norm_topk_prob) == (16, True, False)
    older = {k: v for k, v in asdict(MOE).items() if k not in ("head_dim", "qk_norm")}  # written before they existed
    older["moe"] = {k: v for k, v in older["moe"].items() if k != "norm_topk_prob"}
    got = model_of_checkpoint(TrainConfig(), older, {}, CKPT)
    assert got.identity() == MOE.identity() and (got.head_size, got.qk_norm, got.moe.norm_topk_prob) == (
        12,
        False,
        True,
    )
