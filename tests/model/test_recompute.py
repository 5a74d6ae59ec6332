"""Full activation recompute: the same gradients, bit for bit, from only each block's input kept for backward."""

from __future__ import annotations

import pytest
import torch

from modelpar.bench.meters import SavedTensorMeter
from modelpar.model.activations import ActivationOffload
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_model

CONFIG = ModelConfig(vocab_size=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn_hidden=48, max_seq_len=32)
BATCH, SEQ = 2, 16


def _step(recompute: str, split_blocks=None, modules=("elementwise",), offload=False):
    torch.manual_seed(0)
    model = build_model(CONFIG, seed=3, recompute=recompute, recompute_modules=modules)
    if offload:
        model.offload = ActivationOffload(exclude=list(model.parameters()), min_bytes=0)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    targets = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter:
        loss = model.loss(model(ids), targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, meter if not offload else model.offload


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


def test_an_unknown_recompute_mode_or_module_is_refused():
    with pytest.raises(ValueError, match="recompute='some' must be one of"):
        build_model(CONFIG, seed=0, recompute="some")
    with pytest.raises(ValueError, match=r"recompute_modules: unknown \['norms'\]"):
        build_model(CONFIG, seed=0, recompute="selective", recompute_modules=["mlp", "norms"])
    with pytest.raises(ValueError, match="recompute=selective needs recompute_modules"):
        build_model(CONFIG, seed=0, recompute="selective", recompute_modules=[])


@pytest.mark.parametrize(
    "modules", [("attention",), ("mlp",), ("elementwise",), ("mlp", "elementwise"), ("attention", "mlp")]
)
def test_selective_recompute_gives_bit_identical_loss_and_gradients(modules):
    loss, grads, _ = _step("none")
    loss_rc, grads_rc, _ = _step("selective", modules=modules)
    assert torch.equal(loss, loss_rc)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_rc[name]), name


def test_selective_halves_keep_less_than_none_and_more_than_full():
    _, _, plain = _step("none")
    _, _, full = _step("full")
    _, _, mlp = _step("selective", modules=("mlp",))
    _, _, both = _step("selective", modules=("attention", "mlp"))
    assert full.peak < both.peak < mlp.peak < plain.peak
    bsh = ((BATCH, SEQ, CONFIG.hidden), "float32")
    # rerunning the MLP half keeps its input, instead of the norm's output, gate|up, SwiGLU and its product
    assert mlp.shapes[bsh][0] >= CONFIG.layers


def test_offload_moves_the_saved_activations_and_keeps_the_gradients():
    loss, grads, _ = _step("none")
    loss_off, grads_off, offload = _step("none", offload=True)
    assert torch.equal(loss, loss_off)  # the forward is untouched
    for name, grad in grads.items():  # copies may be laid out contiguously: backward kernels may sum in another order
        torch.testing.assert_close(grads_off[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    # every block's large saved tensors went through the host copy: at least the MLP's gate|up output per layer
    gate_up = BATCH * SEQ * 2 * CONFIG.ffn_hidden * 4
    assert offload.tensors_offloaded >= CONFIG.layers
    assert offload.bytes_offloaded >= CONFIG.layers * gate_up
    param_bytes = sum(p.numel() * 4 for p in build_model(CONFIG, seed=3).parameters())
    assert offload.bytes_offloaded < 40 * param_bytes  # activations only, never the weights themselves


def test_no_grad_forward_skips_the_checkpoint():
    model = build_model(CONFIG, seed=3, recompute="full")
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    with torch.no_grad():
        out = model(ids)
    assert not out.requires_grad
    assert torch.equal(out, build_model(CONFIG, seed=3)(ids).detach())
