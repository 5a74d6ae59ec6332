"""RoPE scaling (linear, llama3, yarn): the frequencies, the cos/sin factor and latent attention's softmax factor
equal transformers' for the configs released models ship; HF configs read and written; dynamic NTK refused."""

from __future__ import annotations

import json

import pytest
import torch

from modelpar.model.config import ModelConfig, ModelConfigError
from modelpar.model.hf import config_from_hf, config_to_hf
from modelpar.model.hf_rope import rope_scaling_from_hf, rope_scaling_to_hf
from modelpar.model.layers import attention
from modelpar.model.rope import RopeScaling, cos_sin_factor, inverse_frequencies, softmax_factor

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

# (name, head dim, theta, max_position_embeddings, rope_parameters): the blocks of released configs, and small
# ones whose frequencies fall in every band
CASES = [
    ("linear", 64, 10000.0, 4096, {"rope_type": "linear", "factor": 4.0}),
    ("llama-3.1-8b", 128, 500000.0, 131072,
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
    ("llama3-tiny", 8, 500.0, 16,
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}),
    ("deepseek-v3", 64, 10000.0, 163840,
     {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 4096}),
    ("qwen2.5-yarn", 128, 1000000.0, 131072,
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("gpt-oss", 64, 150000.0, 131072,
     {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
      "original_max_position_embeddings": 4096}),
    ("yarn-mscale-ratio", 16, 500.0, 64,
     {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.3,
      "original_max_position_embeddings": 8}),
    ("yarn-attention-factor", 16, 500.0, 64,
     {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.9, "original_max_position_embeddings": 8}),
]  # fmt: skip


def _hf_config(head_dim, theta, max_pos, rope):
    return transformers.LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": theta, **rope},
    )  # fmt: skip


@pytest.mark.parametrize("name, head_dim, theta, max_pos, rope", CASES, ids=[c[0] for c in CASES])
def test_frequencies_and_cos_sin_factor_equal_transformers(name, head_dim, theta, max_pos, rope):
    hf = _hf_config(head_dim, theta, max_pos, rope)
    want_freq, want_factor = rope_utils.ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    scaling = rope_scaling_from_hf(hf.to_dict(), name)
    assert scaling.type == rope["rope_type"]
    got = inverse_frequencies(head_dim, theta, scaling)
    assert got.dtype == torch.float32 and got.shape == want_freq.shape
    torch.testing.assert_close(got, want_freq.float(), rtol=2e-6, atol=0)
    assert cos_sin_factor(scaling) == pytest.approx(want_factor, rel=1e-12)
    plain = inverse_frequencies(head_dim, theta)
    assert not torch.equal(got, plain)  # every case scales some frequency


def test_deepseek_softmax_factor_equals_transformers_mscale():
    rope = dict(CASES[3][4], rope_theta=10000.0)
    want = rope_utils.yarn_apply_mscale(rope, 1.0)
    assert softmax_factor(rope_scaling_from_hf({"rope_parameters": rope}, "v3")) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx((0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    for other in CASES[:3] + CASES[4:6]:  # no mscale_all_dim: the softmax scale stays 1/sqrt(d)
        assert softmax_factor(rope_scaling_from_hf({"rope_parameters": other[4]}, other[0])) == 1.0


def test_the_llama3_bands_keep_blend_and_divide():
    s = RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    plain, got = inverse_frequencies(8, 500.0), inverse_frequencies(8, 500.0, s)
    # wavelengths 6.3 (< 64/4: kept), 29.7 (between: blended), 140 and 664 (> 64: divided by 8)
    assert got[0] == plain[0] and plain[1] / 8 < got[1] < plain[1]
    torch.testing.assert_close(got[2:], plain[2:] / 8)


@pytest.mark.parametrize(
    "rope, named",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type=dynamic is not supported: dynamic NTK rescales"),
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type='longrope' is not supported"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_type": "linear", "factor": 0.5}, "factor=0.5 must be >= 1"),
    ],
)
def test_scalings_modelpar_does_not_compute_are_refused_in_one_line(rope, named):
    with pytest.raises(ValueError, match=named) as info:
        rope_scaling_from_hf({"rope_parameters": {"rope_theta": 1e4, **rope}, "max_position_embeddings": 64}, "dir")
    assert "\n" not in str(info.value)


def test_a_recipe_with_dynamic_scaling_is_refused_saying_why():
    with pytest.raises(ModelConfigError, match=r"model.rope_scaling.type=dynamic is not supported: dynamic NTK"):
        ModelConfig(rope_scaling=RopeScaling("dynamic", factor=2.0)).check()


def test_yarn_without_factor_takes_the_ratio_of_lengths_and_a_top_level_original_length_wins():
    hf = {"max_position_embeddings": 64, "original_max_position_embeddings": 16,
          "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 8}}  # fmt: skip
    got = rope_scaling_from_hf(hf, "dir")
    assert (got.factor, got.original_max_position_embeddings) == (4.0, 16)


@pytest.mark.parametrize("name, head_dim, theta, max_pos, rope", CASES, ids=[c[0] for c in CASES])
def test_written_rope_parameters_read_back_and_load_in_transformers(name, head_dim, theta, max_pos, rope):
    scaling = rope_scaling_from_hf({"rope_parameters": rope, "max_position_embeddings": max_pos}, name)
    written = rope_scaling_to_hf(scaling, theta)
    assert rope_scaling_from_hf({"rope_parameters": written}, name) == scaling
    hf = _hf_config(head_dim, theta, max_pos, {k: v for k, v in written.items() if k != "rope_theta"})
    freq, factor = rope_utils.ROPE_INIT_FUNCTIONS[scaling.type](hf)
    torch.testing.assert_close(inverse_frequencies(head_dim, theta, scaling), freq.float(), rtol=2e-6, atol=0)
    assert cos_sin_factor(scaling) == pytest.approx(factor, rel=1e-12)


def test_an_exported_config_carries_the_scaling_and_an_unscaled_one_its_old_block(tmp_path):
    scaled = ModelConfig(rope_theta=500.0, rope_scaling=RopeScaling("linear", factor=2.0))
    hf = config_to_hf(scaled)
    assert hf["rope_parameters"] == {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
    assert config_to_hf(ModelConfig(rope_theta=500.0))["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 500.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert config_from_hf(tmp_path) == scaled


def test_scaling_is_part_of_the_identity_only_when_on_and_reads_back_from_an_index():
    yarn = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8, mscale_all_dim=1.0)
    assert "rope_scaling" not in ModelConfig().identity()
    config = ModelConfig(rope_scaling=yarn)
    assert config.identity()["rope_scaling"]["mscale_all_dim"] == 1.0
    assert "low_freq_factor" not in config.identity()["rope_scaling"]  # a llama3 field: not what yarn reads
    saved = json.loads(json.dumps(config.__dict__, default=lambda o: o.__dict__))  # as a checkpoint index holds it
    assert ModelConfig(**saved).rope_scaling == yarn


def test_scaled_and_plain_tables_are_cached_apart(monkeypatch):
    monkeypatch.setattr(attention, "_ROPE_TABLES", {})
    cpu = torch.device("cpu")
    plain = attention.cached_rope_tables(16, 8, 500.0, cpu)
    linear = attention.cached_rope_tables(16, 8, 500.0, cpu, RopeScaling("linear", factor=2.0))
    yarn = RopeScaling("yarn", factor=8.0, original_max_position_embeddings=4)
    scaled = attention.cached_rope_tables(16, 8, 500.0, cpu, yarn)
    assert len(attention._ROPE_TABLES) == 3
    torch.testing.assert_close(linear[0][2], plain[0][1])  # position 2 at half the frequency is position 1
    radius = (scaled[0].square() + scaled[1].square()).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, cos_sin_factor(yarn)))
    assert attention.cached_rope_tables(16, 8, 500.0, cpu, RopeScaling()) is plain  # default: the plain tables
