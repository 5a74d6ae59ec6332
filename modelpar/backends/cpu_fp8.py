"""FP8 GEMMs on CPU: torch's ``_scaled_mm`` with one scale per tensor runs a slow reference kernel there: 8 ms for a
64 x 32 x 48 product, 7.5 s for bench-tiny's 256 x 256 x 1376 (``benchmarks/results/cpu_fp8_gemm.md``). On CPU
the per-tensor scales are passed as a row and a column of that one value: the same product (within fp32 rounding),
through the kernel a scale per row takes, 80 to 1,200 times faster.
A GPU never sees this (``modelpar.backends.install`` puts it in on CPU ranks only)."""

from __future__ import annotations

import torch


def scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor, **kwargs):
    """``torch._scaled_mm(a, b, ...)`` (a: [M, K], b: [K, N]); on CPU a scalar scale becomes [M, 1] / [1, N]."""
    if a.device.type == "cpu":
        if scale_a.dim() == 0:
            scale_a = scale_a.expand(a.shape[0], 1).contiguous()
        if scale_b.dim() == 0:
            scale_b = scale_b.expand(1, b.shape[1]).contiguous()
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)
