"""RMSNorm: Triton forward and backward (with and without the fused residual add) equal the torch reference."""

import pytest
import torch
from modelpar_kernels import rms_norm

from tests.kernels import BF16_TOL, DEVICE, FP32_TOL, assert_close, requires_cuda

EPS = 1e-5


def _run(backend, x, weight, residual, grads):
    """Forward, then input and weight gradients for the given output gradients."""
    inputs = [x, weight] + ([residual] if residual is not None else [])
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = rms_norm(inputs[0], inputs[1], EPS, inputs[2] if residual is not None else None, backend=backend)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, grads[: len(outs)])
    return [o.detach() for o in outs], [t.grad for t in inputs]


@pytest.mark.parametrize("shape", [(3, 5, 96), (3, 7, 80), (2, 1, 130)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_outputs_and_gradients_match_reference_fp32(shape, with_residual):
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE)
    weight = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    residual = torch.randn(shape, device=DEVICE) if with_residual else None
    grads = [torch.randn(shape, device=DEVICE) for _ in range(2)]
    outs, input_grads = _run("triton", x, weight, residual, grads)
    ref_outs, ref_grads = _run("torch", x, weight, residual, grads)
    names = ["y", "x + residual"][: len(outs)] + ["dx", "dweight", "dresidual"][: len(input_grads)]
    for name, got, want in zip(names, outs + input_grads, ref_outs + ref_grads, strict=True):
        assert_close(got, want, FP32_TOL, name)


def test_weight_gradient_sums_rows_across_programs():
    """More rows than programs: each program's fp32 partial sum must reach the weight gradient."""
    torch.manual_seed(1)
    x = torch.randn(41, 48, device=DEVICE)
    weight = torch.randn(48, device=DEVICE)
    grads = [torch.randn(41, 48, device=DEVICE)]
    _, (_, dweight) = _run("triton", x, weight, None, grads)
    _, (_, ref_dweight) = _run("torch", x, weight, None, grads)
    assert_close(dweight, ref_dweight, FP32_TOL, "dweight")


def test_non_contiguous_input_matches_reference():
    torch.manual_seed(2)
    x = torch.randn(3, 96, 13, device=DEVICE).transpose(1, 2)  # [3, 13, 96], row stride 1 along h is lost
    weight = torch.randn(96, device=DEVICE)
    assert_close(rms_norm(x, weight, EPS, backend="triton"), rms_norm(x, weight, EPS), FP32_TOL, "y")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_bf16_matches_reference_on_gpu(with_residual):
    torch.manual_seed(0)
    shape = (4, 257, 4096)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) if with_residual else None
    grads = [torch.randn_like(x) for _ in range(2)]
    outs, input_grads = _run("triton", x, weight, residual, grads)
    ref_outs, ref_grads = _run("torch", x, weight, residual, grads)
    for got, want in zip(outs + input_grads, ref_outs + ref_grads, strict=True):
        assert_close(got, want, BF16_TOL)
