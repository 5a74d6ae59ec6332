"""FP8 on CPU: per-tensor scales passed to torch as a row and a column of that value give the product torch's
own per-tensor kernel gives (within fp32 rounding), and a CPU rank's trainer multiplies through it."""

from __future__ import annotations

import pytest
import torch

from modelpar.backends import install
from modelpar.backends.cpu_fp8 import scaled_mm
from modelpar.model.layers import fp8
from modelpar.parallel.groups import ParallelGroups
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks


def _operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * k + n)
    a = (torch.randn(m, k, generator=g) * 100).clamp(-448, 448).to(fp8.FP8)
    b = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(fp8.FP8)
    return a, b.t()  # mat2 column-major, as fp8_matmul passes it


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 32, 48), (48, 16, 32)])
def test_per_tensor_scales_give_torchs_per_tensor_product(shape, out_dtype):
    a, b = _operands(*shape)
    sa, sb = torch.tensor(0.0123), torch.tensor(0.37)
    exact = (a.double() @ b.double()) * sa.double() * sb.double()
    torchs = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    got = scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == torchs.shape
    # both within a few roundings of the output dtype of the exact product, relative to its largest element: the
    # two kernels scale at different points, so fp32 outputs may differ in their last bits
    eps = torch.finfo(out_dtype).eps
    for product in (torchs, got):
        assert (product.double() - exact).abs().max() <= 4 * eps * exact.abs().max()


def test_per_row_scales_are_passed_as_they_are():
    a, b = _operands(16, 32, 48)
    sa, sb = torch.rand(16, 1) + 0.5, torch.rand(1, 48) + 0.5
    want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert torch.equal(scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32), want)


def _installed(device: str) -> bool:
    install(ParallelGroups.build(ParallelLayout()), torch.device(device))
    try:
        return fp8._scaled_mm is scaled_mm
    finally:
        fp8.install_gemm(None)


def test_a_cpu_rank_multiplies_through_it_and_another_device_through_torch():
    assert run_on_ranks(1, _installed, "cpu") == [True]
    assert run_on_ranks(1, _installed, "meta") == [False]  # any device but the CPU: torch's own kernel
