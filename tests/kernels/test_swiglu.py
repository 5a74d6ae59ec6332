"""SwiGLU: the Triton gate and its gradients equal the torch reference."""

import pytest
import torch
from modelpar_kernels import swiglu

from tests.kernels import BF16_TOL, DEVICE, FP32_TOL, assert_close, requires_cuda


def _gate_with_grads(backend, gate, up, grad):
    gate, up = (t.detach().clone().requires_grad_() for t in (gate, up))
    out = swiglu(gate, up, backend=backend)
    out.backward(grad)
    return out.detach(), gate.grad, up.grad


@pytest.mark.parametrize("shape", [(3, 13, 96), (3, 5, 80), (7, 5000)], ids=str)
def test_output_and_gradients_match_reference_fp32(shape):
    torch.manual_seed(0)
    gate, up, grad = (4 * torch.randn(shape, device=DEVICE) for _ in range(3))
    for name, got, want in zip(
        ["out", "dgate", "dup"],
        _gate_with_grads("triton", gate, up, grad),
        _gate_with_grads("torch", gate, up, grad),
        strict=True,
    ):
        assert_close(got, want, FP32_TOL, name)


def test_halves_of_a_fused_projection_match_reference():
    """gate and up as the two halves of one [.., 2f] projection output (strided views)."""
    torch.manual_seed(1)
    fused = torch.randn(3, 13, 2 * 96, device=DEVICE)
    gate, up = fused.chunk(2, dim=-1)
    grad = torch.randn(3, 13, 96, device=DEVICE)
    for got, want in zip(
        _gate_with_grads("triton", gate, up, grad), _gate_with_grads("torch", gate, up, grad), strict=True
    ):
        assert_close(got, want, FP32_TOL)


@requires_cuda
@pytest.mark.gpu
def test_bf16_matches_reference_on_gpu():
    torch.manual_seed(0)
    gate, up, grad = (torch.randn(4, 1000, 11008, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for got, want in zip(
        _gate_with_grads("triton", gate, up, grad), _gate_with_grads("torch", gate, up, grad), strict=True
    ):
        assert_close(got, want, BF16_TOL)
