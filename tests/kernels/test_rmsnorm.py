"""RMSNorm: Triton forward and backward equal the torch reference."""

import pytest
import torch
from modelpar_kernels import rms_norm

from tests.kernels import BF16_TOL, DEVICE, FP32_TOL, assert_close, requires_cuda

EPS = 1e-5


def _run(backend, x, weight, grad):
    """Forward, then input and weight gradients for the given output gradient."""
    x, weight = (t.detach().clone().requires_grad_() for t in (x, weight))
    y = rms_norm(x, weight, EPS, backend=backend)
    y.backward(grad)
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize("shape", [(3, 5, 96), (3, 7, 80), (2, 1, 130)], ids=str)
def test_outputs_and_gradients_match_reference_fp32(shape):
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE)
    weight = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    grad = torch.randn(shape, device=DEVICE)
    got, want = _run("triton", x, weight, grad), _run("torch", x, weight, grad)
    for name, a, b in zip(["y", "dx", "dweight"], got, want, strict=True):
        assert_close(a, b, FP32_TOL, name)


def test_weight_gradient_sums_rows_across_programs():
    """More rows than programs: each program's fp32 partial sum must reach the weight gradient."""
    torch.manual_seed(1)
    x = torch.randn(41, 48, device=DEVICE)
    weight = torch.randn(48, device=DEVICE)
    grad = torch.randn(41, 48, device=DEVICE)
    _, _, dweight = _run("triton", x, weight, grad)
    _, _, ref_dweight = _run("torch", x, weight, grad)
    assert_close(dweight, ref_dweight, FP32_TOL, "dweight")


def test_non_contiguous_input_matches_reference():
    torch.manual_seed(2)
    x = torch.randn(3, 96, 13, device=DEVICE).transpose(1, 2)  # [3, 13, 96], row stride 1 along h is lost
    weight = torch.randn(96, device=DEVICE)
    assert_close(rms_norm(x, weight, EPS, backend="triton"), rms_norm(x, weight, EPS), FP32_TOL, "y")


@requires_cuda
@pytest.mark.gpu
def test_bf16_matches_reference_on_gpu():
    torch.manual_seed(0)
    shape = (4, 257, 4096)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    for got, want in zip(_run("triton", x, weight, grad), _run("torch", x, weight, grad), strict=True):
        assert_close(got, want, BF16_TOL)
