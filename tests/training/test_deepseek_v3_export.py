"""A DeepSeek-V3 (latent attention, sigmoid group-limited routing whose balancing bias moves as it trains, a shared
expert, a dense first layer) trained at tp2 x ep2 by the trainer exports to a directory transformers loads with the
same loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.config import MLAConfig, ModelConfig, MoEConfig
from modelpar.testing import run_on_ranks
from tests.helpers import make_config

transformers = pytest.importorskip("transformers")

V3 = ModelConfig(
    name="deepseek-v3-test", vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=4, ffn_hidden=40, max_seq_len=32,
    init_std=0.2,
    mla=MLAConfig(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    moe=MoEConfig(
        experts=4, top_k=2, ffn_hidden=16, shared_experts=1, router="sigmoid", n_group=2, topk_group=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, bias_update_rate=0.05,
    ),
)  # fmt: skip
IDS = torch.tensor([[3, 17, 60, 0, 42, 9, 9, 31, 5], [59, 1, 2, 44, 12, 37, 50, 8, 8]])


def _train_then_export(cfg, data_path, out):
    """Train ``cfg.trainer.steps`` steps, export (collective over tp and ep); the loss before and after, the bias."""
    from modelpar.model.hf import export_hf
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    (chunk,) = trainer.model.chunks
    with torch.no_grad():
        initial = chunk.loss(chunk(IDS[:, :-1]), IDS[:, 1:]).item()
    for _ in range(cfg.trainer.steps):
        trainer.train_step()
    if trainer.groups.dp_rank < 2:  # the ranks of one ep group (dp 0 and 1 of the tp pair)
        export_hf(chunk, out)
    with torch.no_grad():
        loss = chunk.loss(chunk(IDS[:, :-1]), IDS[:, 1:]).item()
    bias = chunk.logical_shards()["layers.1.mlp.gate.e_score_correction_bias"].tensor.clone()
    return initial, loss, bias


def test_deepseek_v3_trained_at_tp2_ep2_exports_to_transformers_with_the_same_loss(token_path, tmp_path):
    cfg = make_config(tmp_path / "run", tp=2, dp=2, ep=2)
    cfg = replace(cfg, model=V3, trainer=replace(cfg.trainer, steps=2))
    results = run_on_ranks(4, _train_then_export, cfg, token_path, tmp_path / "hf")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (hf.config.first_k_dense_replace, hf.config.n_group, hf.config.n_shared_experts) == (1, 2, 1)
    exported_bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    with torch.no_grad():
        logits = hf(IDS[:, :-1]).logits
    want = F.cross_entropy(logits.flatten(0, 1), IDS[:, 1:].flatten()).item()
    for initial, loss, bias in results:
        assert loss == pytest.approx(want, rel=1e-5)
        assert abs(loss - initial) > 1e-3 * initial  # it trained: the exported weights are not the initial ones
        assert torch.count_nonzero(bias) > 0 and torch.equal(bias, exported_bias)  # the bias moved, and travelled
