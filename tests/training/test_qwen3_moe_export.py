"""A Qwen3-MoE trained at tp2 x ep2 by the trainer exports to a directory transformers loads with the same loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.testing import run_on_ranks
from tests.helpers import make_config

transformers = pytest.importorskip("transformers")

QWEN3_MOE = ModelConfig(  # layer 1 of 2 a mixture of experts, QK-norm, d = 12 (not hidden/heads), no renormalising
    name="qwen3-moe-test", vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=12, qk_norm=True,
    ffn_hidden=40, max_seq_len=32, init_std=0.2,
    moe=MoEConfig(experts=4, top_k=2, ffn_hidden=24, layers=[1], norm_topk_prob=False),
)  # fmt: skip
IDS = torch.tensor([[3, 17, 60, 0, 42, 9, 9, 31, 5], [59, 1, 2, 44, 12, 37, 50, 8, 8]])


def _train_then_export(cfg, data_path, out):
    """Train ``cfg.trainer.steps`` steps, export (collective over tp and ep), return the trained model's loss."""
    from modelpar.model.hf import export_hf
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    losses = [trainer.train_step().loss for _ in range(cfg.trainer.steps)]
    (chunk,) = trainer.model.chunks
    if trainer.groups.dp_rank < 2:  # the ranks of one ep group (dp 0 and 1 of the tp pair)
        export_hf(chunk, out)
    with torch.no_grad():
        loss = chunk.loss(chunk(IDS[:, :-1]), IDS[:, 1:]).item()
    return losses, loss


def test_qwen3_moe_trained_at_tp2_ep2_exports_to_transformers_with_the_same_loss(token_path, tmp_path):
    cfg = make_config(tmp_path / "run", tp=2, dp=2, ep=2)
    cfg = replace(cfg, model=QWEN3_MOE)
    results = run_on_ranks(4, _train_then_export, cfg, token_path, tmp_path / "hf")
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.mlp_only_layers == [0] and hf.config.norm_topk_prob is False
    with torch.no_grad():
        logits = hf(IDS[:, :-1]).logits
    want = F.cross_entropy(logits.flatten(0, 1), IDS[:, 1:].flatten()).item()
    for losses, loss in results:
        assert loss == pytest.approx(want, rel=1e-5)
        assert losses[-1] < losses[0]  # it trained: the exported weights are not the initial ones
