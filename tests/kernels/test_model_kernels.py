"""The model with ``kernels="triton"`` computes the same loss and gradients as with ``kernels="torch"``."""

from dataclasses import replace

import pytest
import torch
from modelpar_kernels.grid import interpreting

from modelpar import ParallelLayout
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_model
from modelpar.optim.finalize import reduce_tensor_parallel_grads
from modelpar.testing import current_groups, run_on_ranks
from tests.kernels import ATTENTION_FP32_TOL, DEVICE, FP32_TOL, assert_close

SEED = 7
BATCH, SEQ = 3, 13

CONFIGS = {
    "gqa2-tied": ModelConfig(
        vocab_size=61, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=16, init_std=0.2,
        tie_embeddings=True,
    ),
    "gqa4-untied": ModelConfig(
        vocab_size=53, hidden=64, layers=2, heads=4, kv_heads=1, ffn_hidden=20, max_seq_len=16, init_std=0.2
    ),
    "qknorm-hd24": ModelConfig(  # Qwen3-style: per-head RMSNorm of q and k (the RMSNorm kernel over d), d != h/heads
        vocab_size=61, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=24, qk_norm=True, ffn_hidden=40,
        max_seq_len=16, init_std=0.2,
    ),
}  # fmt: skip


def _batch(config):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
    targets[0, :3] = -100
    return ids, targets


def _loss_and_grads(config, kernels, groups=None, device=DEVICE):
    model = build_model(replace(config, kernels=kernels), groups, seed=SEED, device=device)
    ids, targets = (t.to(device) for t in _batch(config))
    loss = model.loss(model(ids), targets)
    loss.backward()
    if groups is not None:
        reduce_tensor_parallel_grads(model)
    return loss.detach().cpu(), {name: p.grad.detach().cpu() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", CONFIGS)
def test_triton_kernels_match_torch_kernels_single_device(name):
    loss, grads = _loss_and_grads(CONFIGS[name], "triton")
    ref_loss, ref_grads = _loss_and_grads(CONFIGS[name], "torch")
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    assert grads.keys() == ref_grads.keys()
    for param, grad in grads.items():
        assert_close(grad, ref_grads[param], ATTENTION_FP32_TOL, param)


def _tp_loss_and_grads(config, kernels):
    return _loss_and_grads(config, kernels, current_groups(), device="cpu")


@pytest.mark.skipif(not interpreting(), reason="emulated ranks run on CPU: needs Triton's interpreter")
def test_triton_kernels_match_torch_kernels_at_tp2():
    config = CONFIGS["gqa2-tied"]
    layout = ParallelLayout(tp=2)
    got = run_on_ranks(2, _tp_loss_and_grads, config, "triton", layout=layout, timeout_s=300)
    want = run_on_ranks(2, _tp_loss_and_grads, config, "torch", layout=layout, timeout_s=300)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert_close(loss, ref_loss, FP32_TOL, "loss")
        for param, grad in grads.items():
            assert_close(grad, ref_grads[param], ATTENTION_FP32_TOL, param)
