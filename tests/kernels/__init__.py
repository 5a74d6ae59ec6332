"""Kernel tests: each Triton kernel against its torch reference, on small odd shapes.

fp32 tests run on CUDA when there is one, else on CPU in Triton's interpreter; bf16 tests need CUDA.
"""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = 1e-5  # max |triton - reference| / max |reference|
ATTENTION_FP32_TOL = 1e-4
BF16_TOL = 2e-2

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest elementwise difference relative to the largest reference magnitude."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    scale = expected.detach().float().abs().max().clamp(min=1e-30)
    return ((actual.detach().float() - expected.detach().float()).abs().max() / scale).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    err = relative_error(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"
