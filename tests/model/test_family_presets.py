"""The gemma3-27b, olmo2-32b and gpt-oss-120b model presets load through the model's schema, pass its checks,
and hold the published parameter counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from modelpar.model.config import ModelConfig

PRESETS = Path(__file__).resolve().parents[2] / "recipes" / "model"

PUBLISHED = {  # total parameters (text model; GPT-OSS: all experts), active per token
    "gemma3-27b": (27.0e9, None),
    "olmo2-32b": (32.2e9, None),
    "gpt-oss-120b": (116.8e9, 5.1e9),
}


def load_model(name: str) -> ModelConfig:
    """``recipes/model/<name>.yaml`` through the model's schema, as the trainer reads it."""
    return OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(PRESETS / f"{name}.yaml"))
    )


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_family_preset_has_the_published_size(name):
    config = load_model(name)
    config.check()
    total, active = PUBLISHED[name]
    assert config.total_params() == pytest.approx(total, rel=0.01)
    if active is not None:
        assert config.matmul_params() == pytest.approx(active, rel=0.01)


def test_family_presets_keep_their_structure():
    assert load_model("gemma3-27b").block.norm == "sandwich"
    assert load_model("olmo2-32b").block.qk_norm_scope == "projection"
    gpt = load_model("gpt-oss-120b")
    assert gpt.block.attention_sinks and gpt.moe.activation == "clamped_swiglu" and gpt.rope_scaling.type == "yarn"
