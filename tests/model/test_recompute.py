"""Full activation recompute: the same gradients, bit for bit, from only each block's input kept for backward."""

from __future__ import annotations

import pytest
import torch

from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_model
from modelpar.perf.memory import SavedTensorMeter

CONFIG = ModelConfig(vocab_size=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn_hidden=48, max_seq_len=32)
BATCH, SEQ = 2, 16


def _step(recompute: str, split_blocks=None):
    torch.manual_seed(0)
    model = build_model(CONFIG, seed=3, recompute=recompute)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    targets = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter:
        loss = model.loss(model(ids), targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, meter


def test_full_recompute_gives_bit_identical_loss_and_gradients():
    loss, grads, _ = _step("none")
    loss_rc, grads_rc, _ = _step("full")
    assert torch.equal(loss, loss_rc)
    assert grads.keys() == grads_rc.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, grads_rc[name]), name


def test_full_recompute_keeps_one_activation_per_block_plus_the_heads():
    _, _, plain = _step("none")
    _, _, full = _step("full")
    bsh = ((BATCH, SEQ, CONFIG.hidden), "float32")
    # each block's input, the final norm's input and the head's (normed) input
    assert full.shapes[bsh][0] == CONFIG.layers + 2
    assert full.peak < plain.peak / 4
    assert plain.live == full.live == 0  # everything released by backward


def test_recompute_is_refused_unless_none_or_full():
    with pytest.raises(ValueError, match="recompute='selective' must be one of"):
        build_model(CONFIG, seed=0, recompute="selective")


def test_no_grad_forward_skips_the_checkpoint():
    model = build_model(CONFIG, seed=3, recompute="full")
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    with torch.no_grad():
        out = model(ids)
    assert not out.requires_grad
    assert torch.equal(out, build_model(CONFIG, seed=3)(ids).detach())
