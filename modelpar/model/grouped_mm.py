"""Each expert's linear layer on its own rows, in one call: torch's grouped matmul (``torch._grouped_mm``) over
the rows sorted by expert, with a backward of two more grouped matmuls; a loop of matmuls, one per expert, where
the grouped op is missing or refuses the shapes, and as the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _GroupedMatmul(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e].T`` for contiguous row groups ending at ``offsets`` (torch's grouped
    matmul; its backward is two more grouped matmuls). x: [n, in], w: [E, out, in] -> [n, out]."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return torch._grouped_mm(x, w.to(x.dtype).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, w.to(grad.dtype), offs=offsets)
        grad_w = torch._grouped_mm(grad.t(), x.to(grad.dtype), offs=offsets).to(w.dtype)
        return grad_x, grad_w, None


def _grouped_ok(x: torch.Tensor, *widths: int) -> bool:
    """torch's grouped matmul needs rows aligned to 16 bytes; without it (or the op) use the loop."""
    return hasattr(torch, "_grouped_mm") and all(width * x.element_size() % 16 == 0 for width in widths)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped: bool = True) -> torch.Tensor:
    """Each expert's linear layer on its rows: x [n, in] sorted by expert, ``counts[e]`` rows each ([E], sum n),
    w [E, out, in] -> [n, out]. ``grouped=False`` (or shapes the grouped matmul refuses): one matmul per
    expert, the reference."""
    if grouped and _grouped_ok(x, w.shape[1], w.shape[2]):
        offsets = counts.cumsum(0).to(torch.int32)
        return _GroupedMatmul.apply(x, w, offsets)
    pieces = x.split(counts.tolist())
    return torch.cat([F.linear(piece, w[e].to(x.dtype)) for e, piece in enumerate(pieces)])
