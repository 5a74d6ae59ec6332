"""Backend dispatch: "auto" follows the device, "triton" on CPU runs the interpreted kernels, bad names fail."""

import pytest
import torch
from modelpar_kernels import grid, resolve_backend, rms_norm, swiglu
from modelpar_kernels.rmsnorm import RMSNormFunction


def test_auto_resolves_to_triton_on_cuda_and_torch_elsewhere():
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("triton", "cpu") == "triton"


def test_unknown_backend_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match=r"model.kernels='cutlass' is not one of \('auto', 'triton', 'torch'\)"):
        swiglu(torch.ones(2), torch.ones(2), backend="cutlass")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch")
def test_triton_backend_on_cpu_runs_the_kernel_in_the_interpreter():
    assert grid.interpreting()
    x = torch.randn(3, 8, requires_grad=True)
    y = rms_norm(x, torch.ones(8), 1e-6, backend="triton")
    assert y.grad_fn.name() == f"{RMSNormFunction.__name__}Backward"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch")
def test_auto_backend_on_cpu_uses_the_reference():
    x = torch.randn(3, 8, requires_grad=True)
    assert "RMSNormFunction" not in rms_norm(x, torch.ones(8), 1e-6, backend="auto").grad_fn.name()
