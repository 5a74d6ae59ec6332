"""The FP8 linear computes, forward and in both backward GEMMs, the float product of the same quantization, with
the scales its rule gives; the model with fp8 on differs from (and stays close to) the model with it off."""

from dataclasses import replace

import pytest
import torch

from modelpar.model.config import ModelConfigError
from modelpar.model.layers.fp8 import FP8_MAX, Fp8Scaling, fp8_linear, scale_of
from modelpar.model.transformer import build_model
from modelpar.parallel.layout import LayoutError, ParallelLayout
from tests.helpers import TINY

MODES = ["rowwise", "tensorwise"]


def _fake_quant(t: torch.Tensor, mode: str) -> torch.Tensor:
    """Quantize ``t`` [r, c] to e4m3 along c (rowwise) or as a whole (tensorwise) and back, in fp64."""
    amax = t.abs().amax() if mode == "tensorwise" else t.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.double() * scale.double()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    # odd shapes (no multiple of 16), a batch dimension, a zero row, and features of very different sizes
    x = torch.randn(3, 7, 21, generator=g) * torch.logspace(-2, 1, 21)
    x[1, 2] = 0.0
    w = torch.randn(13, 21, generator=g) * 0.1
    gy = torch.randn(3, 7, 13, generator=g)
    return x, w, gy


@pytest.mark.parametrize("mode", MODES)
def test_forward_and_both_gradients_equal_the_float_product_of_the_same_quantization(mode):
    x, w, gy = _inputs()
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = fp8_linear(x, w, Fp8Scaling(mode))
    y.backward(gy)
    x2, g2 = x.detach().reshape(-1, 21).double(), gy.reshape(-1, 13).double()
    wd = w.detach().double()
    ref_y = _fake_quant(x2, mode) @ _fake_quant(wd, mode).T
    ref_dx = _fake_quant(g2, mode) @ _fake_quant(wd.T.contiguous(), mode).T  # W quantized along its outputs
    ref_dw = _fake_quant(g2.T.contiguous(), mode) @ _fake_quant(x2.T.contiguous(), mode).T  # along the tokens
    torch.testing.assert_close(y.reshape(-1, 13).double(), ref_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.reshape(-1, 21).double(), ref_dx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), ref_dw, rtol=1e-6, atol=1e-6)
    # and the quantization is real: the fp32 product differs by far more than the tolerance above
    assert (y.detach() - x.detach() @ w.detach().T).abs().max() > 1e-3


def test_rowwise_scales_are_per_row_amax_over_448_and_tensorwise_one_scalar():
    x, _, _ = _inputs()
    t = x.reshape(-1, 21)
    rows = scale_of(Fp8Scaling("rowwise").amax(t, ("tokens", "in")))
    expected = t.abs().amax(dim=1, keepdim=True) / FP8_MAX
    expected[(t == 0).all(dim=1)] = 1.0  # the zero row: scale 1, so it quantizes to zeros, not NaN
    assert rows.shape == (21, 1) and (t == 0).all(dim=1).any()
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)
    whole = scale_of(Fp8Scaling("tensorwise").amax(t, ("tokens", "in")))
    assert whole.shape == () and whole.item() == pytest.approx(t.abs().max().item() / FP8_MAX, rel=1e-7)


def test_bf16_autocast_gives_bf16_outputs_and_fp32_weight_gradients():
    x, w, _ = _inputs()
    w.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w, Fp8Scaling("rowwise"))
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("mode", MODES)
def test_fp8_model_is_close_to_the_fp32_model_but_not_equal(mode):
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = build_model(TINY, seed=0)(ids)
    fp8 = build_model(TINY, seed=0, fp8=mode)(ids)
    assert not torch.allclose(plain, fp8, atol=1e-5)
    torch.testing.assert_close(fp8, plain, rtol=0.1, atol=0.05)
    # only the attention and MLP projections run in FP8; the embedding, norms and head stay as they were
    model = build_model(TINY, seed=0, fp8=mode)
    assert model.lm_head.fp8 is None and model.layers["0"].mlp.down_proj.fp8.mode == mode


def test_fp8_refuses_moe_and_replicated_kv_heads_in_one_line():
    moe = replace(TINY, fp8="rowwise", moe=replace(TINY.moe, experts=4, top_k=2))
    with pytest.raises(ModelConfigError, match=r"model.fp8=rowwise covers dense layers only.*model.moe.experts=0"):
        moe.check()
    with pytest.raises(LayoutError, match=r"tp=4 > model.kv_heads=2.*model.fp8=off"):
        replace(TINY, fp8="tensorwise").check_layout(ParallelLayout(tp=4))
    with pytest.raises(ModelConfigError, match="model.fp8='fp4' must be one of off, rowwise, tensorwise"):
        replace(TINY, fp8="fp4").check()
