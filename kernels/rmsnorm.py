"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight``, optionally after a fused residual add."""

from __future__ import annotations

import torch


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., h], weight: [h]. With ``residual``: returns ``(norm(x + residual), x + residual)``."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return (y, x) if residual is not None else y
