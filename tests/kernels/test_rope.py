"""RoPE: the Triton rotation and its gradient equal the torch reference, for q and k head counts and offsets."""

import pytest
import torch
from einops import rearrange
from modelpar_kernels import apply_rope, rope_tables

from tests.kernels import BF16_TOL, DEVICE, FP32_TOL, assert_close, requires_cuda


def _rotate_with_grad(backend, x, cos, sin, grad):
    x = x.detach().clone().requires_grad_()
    y = apply_rope(x, cos, sin, backend=backend)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.mark.parametrize("n_heads", [4, 2, 1], ids=lambda n: f"heads{n}")
@pytest.mark.parametrize("head_dim", [80, 16, 6], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("offset", [0, 7], ids=lambda o: f"offset{o}")
def test_rotation_and_gradient_match_reference_fp32(n_heads, head_dim, offset):
    torch.manual_seed(0)
    x = torch.randn(3, 13, n_heads, head_dim, device=DEVICE)
    cos, sin = rope_tables(13, head_dim, theta=10000.0, offset=offset, device=DEVICE)
    grad = torch.randn_like(x)
    y, dx = _rotate_with_grad("triton", x, cos, sin, grad)
    ref_y, ref_dx = _rotate_with_grad("torch", x, cos, sin, grad)
    assert_close(y, ref_y, FP32_TOL, "y")
    assert_close(dx, ref_dx, FP32_TOL, "dx")


def test_strided_view_of_fused_qkv_matches_reference():
    """q and k sliced out of one fused projection keep their strides; no copy is needed to rotate them."""
    torch.manual_seed(1)
    qkv = torch.randn(3, 37, 4 + 2 + 2, 32, device=DEVICE)
    q, k = qkv[:, :, :4], qkv[:, :, 4:6]
    cos, sin = rope_tables(37, 32, theta=500000.0, device=DEVICE)
    for name, x in (("q", q), ("k", k)):
        grad = torch.randn_like(x)
        y, dx = _rotate_with_grad("triton", x, cos, sin, grad)
        ref_y, ref_dx = _rotate_with_grad("torch", x, cos, sin, grad)
        assert_close(y, ref_y, FP32_TOL, name)
        assert_close(dx, ref_dx, FP32_TOL, f"d{name}")


def test_mismatched_tables_are_rejected():
    x = torch.randn(1, 5, 2, 8, device=DEVICE)
    cos, sin = rope_tables(4, 8, theta=10000.0, device=DEVICE)
    with pytest.raises(ValueError, match=r"cos/sin must be \[5, 4\]"):
        apply_rope(x, cos, sin, backend="triton")


@requires_cuda
@pytest.mark.gpu
def test_bf16_matches_reference_on_gpu():
    torch.manual_seed(0)
    x = rearrange(torch.randn(2, 32, 1000, 128, device="cuda", dtype=torch.bfloat16), "b h s d -> b s h d")
    cos, sin = rope_tables(1000, 128, theta=500000.0, offset=3, device="cuda")
    grad = torch.randn_like(x)
    for got, want in zip(
        _rotate_with_grad("triton", x, cos, sin, grad), _rotate_with_grad("torch", x, cos, sin, grad), strict=True
    ):
        assert_close(got, want, BF16_TOL)


def test_scaled_tables_rotation_and_gradient_match_reference():
    """Scaled tables (other frequencies, cos and sin multiplied by YaRN's attention factor): the same kernel, its
    backward still the transpose."""
    torch.manual_seed(2)
    x = torch.randn(2, 11, 3, 12, device=DEVICE)
    inv_freq = torch.tensor([1.0, 0.3, 0.02, 0.004, 1e-4, 3e-5])
    cos, sin = rope_tables(11, 12, theta=10000.0, device=DEVICE, inv_freq=inv_freq, scale=1.37)
    assert torch.allclose(cos.square() + sin.square(), torch.full_like(cos, 1.37**2))
    grad = torch.randn_like(x)
    y, dx = _rotate_with_grad("triton", x, cos, sin, grad)
    ref_y, ref_dx = _rotate_with_grad("torch", x, cos, sin, grad)
    assert_close(y, ref_y, FP32_TOL, "y")
    assert_close(dx, ref_dx, FP32_TOL, "dx")
    # the reference's gradient is the transpose of the scaled rotation, not its inverse
    x1 = x.detach().clone().requires_grad_()
    torch.autograd.backward(apply_rope(x1, cos, sin), grad)
    assert torch.allclose(x1.grad.square().sum(), (grad * 1.37).square().sum(), rtol=1e-4)
