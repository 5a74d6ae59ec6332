"""Flash attention: output and q/k/v gradients equal torch SDPA, causal and not, for GQA ratios 1, 2 and 4."""

import pytest
import torch
from modelpar_kernels import attention

from tests.kernels import ATTENTION_FP32_TOL, BF16_TOL, DEVICE, assert_close, requires_cuda


def _attend_with_grads(backend, q, k, v, grad, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal, backend=backend)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _check(q, k, v, causal, tol):
    grad = torch.randn_like(q)
    got = _attend_with_grads("triton", q, k, v, grad, causal)
    want = _attend_with_grads("torch", q, k, v, grad, causal)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want, strict=True):
        assert_close(a, b, tol, name)


def _qkv(b, s, hq, hkv, d, device=DEVICE, dtype=torch.float32):
    return (torch.randn(b, s, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("seq_len", [13, 37], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("head_dim", [16, 32], ids=lambda d: f"d{d}")
def test_causal_matches_reference_fp32(hq, hkv, seq_len, head_dim):
    torch.manual_seed(0)
    _check(*_qkv(3, seq_len, hq, hkv, head_dim), causal=True, tol=ATTENTION_FP32_TOL)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)], ids=["mha", "gqa4"])
def test_non_causal_matches_reference_fp32(hq, hkv):
    torch.manual_seed(1)
    _check(*_qkv(3, 37, hq, hkv, 16), causal=False, tol=ATTENTION_FP32_TOL)


def test_head_dim_that_is_not_a_power_of_two_matches_reference_fp32():
    torch.manual_seed(2)
    _check(*_qkv(2, 20, 2, 1, 24), causal=True, tol=ATTENTION_FP32_TOL)


def test_strided_views_of_fused_qkv_match_reference_fp32():
    """q, k, v sliced out of one projection output: the kernels read the strides, nothing is repeated."""
    torch.manual_seed(3)
    qkv = torch.randn(3, 13, 4 + 2 + 2, 16, device=DEVICE)
    _check(qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:], causal=True, tol=ATTENTION_FP32_TOL)


def test_mismatched_kv_heads_are_rejected():
    q, k, v = _qkv(1, 8, 4, 3, 16)
    with pytest.raises(ValueError, match="hkv dividing 4"):
        attention(q, k, v, backend="triton")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)], ids=["mha", "gqa4"])
def test_bf16_matches_reference_on_gpu(head_dim, hq, hkv):
    torch.manual_seed(0)
    _check(*_qkv(2, 1000, hq, hkv, head_dim, device="cuda", dtype=torch.bfloat16), causal=True, tol=BF16_TOL)
