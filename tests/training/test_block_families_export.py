"""OLMo 2, Gemma 3 and Gemma 2 blocks trained at tp2, and GPT-OSS at tp2 x ep2, by the trainer export to
directories transformers loads with the trained model's loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.model.rope import RopeScaling
from modelpar.model.structure import BlockStructure
from modelpar.testing import run_on_ranks
from tests.helpers import make_config

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=32, init_std=0.2)
GEMMA = dict(norm="sandwich", norm_offset=1.0, activation="geglu", embedding_scale=True, query_scale=10.0)
FAMILIES = {  # name: (config, transformers class)
    "olmo2": (
        ModelConfig(
            name="olmo2-test", **SHAPE, qk_norm=True, block=BlockStructure(norm="post", qk_norm_scope="projection")
        ),
        "Olmo2ForCausalLM",
    ),
    "gemma3": (
        ModelConfig(
            name="gemma3-test", **SHAPE, head_dim=12, qk_norm=True, tie_embeddings=True, sliding_window=3,
            window_layers=[0], block=BlockStructure(**GEMMA, final_softcap=1.5, local_rope_theta=20.0),
        ),
        "Gemma3ForCausalLM",
    ),
    "gemma2": (
        ModelConfig(
            name="gemma2-test", **SHAPE, tie_embeddings=True, sliding_window=3, window_layers=[0],
            block=BlockStructure(**GEMMA, attention_softcap=1.0, final_softcap=1.5),
        ),
        "Gemma2ForCausalLM",
    ),
}  # fmt: skip
GPT_OSS = ModelConfig(
    name="gpt-oss-test", **SHAPE | {"ffn_hidden": 16}, sliding_window=3, window_layers=[0], attention_bias=True,
    attention_out_bias=True, rope_theta=150000.0,
    rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=8, truncate=False),
    moe=MoEConfig(experts=4, top_k=2, bias=True, activation="clamped_swiglu", swiglu_limit=0.5),
    block=BlockStructure(attention_sinks=True),
)  # fmt: skip
IDS = torch.tensor([[3, 17, 60, 0, 42, 9, 9, 31, 5], [59, 1, 2, 44, 12, 37, 50, 8, 8]])


def _train_then_export(cfgs, data_path, root):
    """For each family: train ``cfg.trainer.steps`` steps, export (collective over tp); its loss on IDS before
    and after training."""
    from modelpar.model.hf import export_hf
    from modelpar.training.trainer import Trainer

    results = {}
    for family, cfg in cfgs.items():  # under ep, the ranks of one ep group (dp 0 and 1 of a tp pair) export
        trainer = Trainer(cfg, data_path, None)
        (chunk,) = trainer.model.chunks
        with torch.no_grad():
            before = chunk.loss(chunk(IDS[:, :-1]), IDS[:, 1:]).item()
        for _ in range(cfg.trainer.steps):
            trainer.train_step()
        if trainer.groups.dp_rank < cfg.parallel.ep:
            export_hf(chunk, root / family)
        with torch.no_grad():
            results[family] = before, chunk.loss(chunk(IDS[:, :-1]), IDS[:, 1:]).item()
    return results


def test_block_families_trained_at_tp2_export_to_transformers_with_the_same_loss(token_path, tmp_path):
    cfgs = {
        family: replace(make_config(tmp_path / family, tp=2, dp=2), model=model)
        for family, (model, _) in FAMILIES.items()
    }
    cfgs["gpt_oss"] = replace(make_config(tmp_path / "gpt_oss", tp=2, dp=2, ep=2), model=GPT_OSS)
    results = run_on_ranks(4, _train_then_export, cfgs, token_path, tmp_path / "hf")
    for family, cls in {**{f: cls for f, (_, cls) in FAMILIES.items()}, "gpt_oss": "GptOssForCausalLM"}.items():
        hf = getattr(transformers, cls).from_pretrained(tmp_path / "hf" / family).eval()
        with torch.no_grad():
            logits = hf(IDS[:, :-1]).logits
        want = F.cross_entropy(logits.flatten(0, 1), IDS[:, 1:].flatten()).item()
        for rank in results:
            before, after = rank[family]
            assert after == pytest.approx(want, rel=1e-5), family
            assert abs(after - before) > 1e-3, family  # it trained: the exported weights are not the initial ones
