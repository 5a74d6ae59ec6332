"""Attention sinks (``model.block.attention_sinks``) are GPT-OSS's: with its experts' outputs zeroed, a random
``GptOssForCausalLM`` (sinks, q/k/v/o biases, sliding and full layers, YaRN) and our dense model holding the
same attention, norm, embedding and head weights give the same loss (the layouts: ``test_structure.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.config import ModelConfig
from modelpar.model.hf_rope import rope_scaling_from_hf
from modelpar.model.structure import BlockStructure
from modelpar.model.transformer import build_model
from tests.model.layouts import IDS

transformers = pytest.importorskip("transformers")

ROPE = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
    "rope_theta": 150000.0, "truncate": False,
}  # fmt: skip
SHAPE = dict(
    vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
    sliding_window=3, initializer_range=0.2, rope_parameters=ROPE, layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss():
    """transformers' model with its experts' outputs zeroed (down_proj and its bias) and sinks that matter, its
    loss on IDS, and its state dict."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SHAPE)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.down_proj", "experts.down_proj_bias")):
                param.zero_()
            elif name.endswith(("sinks", "norm.weight")):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 1.0 if name.endswith("sinks") else 0.2)
        logits = model(IDS[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), IDS[:, 1:].flatten()).item(), model.state_dict()


def _ours(state):
    rope = rope_scaling_from_hf({"rope_parameters": ROPE, "max_position_embeddings": 16}, "gpt-oss")
    config = ModelConfig(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn_hidden=16, max_seq_len=16,
        rope_theta=150000.0, rope_scaling=rope,
        norm_eps=1e-5, sliding_window=3, window_layers=[0], attention_bias=True, attention_out_bias=True,
        block=BlockStructure(attention_sinks=True),
    )  # fmt: skip
    model = build_model(config, seed=0)
    model.load_logical(
        lambda name, shard: (
            torch.zeros(shard.global_shape)
            if ".mlp." in name
            else state[name if name == "lm_head.weight" else f"model.{name}"]
        )[shard.index]
    )
    return model


def test_sinks_biases_windows_and_yarn_give_transformers_gpt_oss_attention(gpt_oss):
    want, state = gpt_oss
    model = _ours(state)
    with torch.no_grad():
        got = model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item()
    assert got == pytest.approx(want, rel=1e-5)
    without = _ours(state | {k: torch.zeros_like(v) for k, v in state.items() if k.endswith("sinks")})
    with torch.no_grad():  # sinks at 0 still take their share of each softmax: the test sees them
        assert without.loss(without(IDS[:, :-1]), IDS[:, 1:]).item() != pytest.approx(want, rel=1e-3)
