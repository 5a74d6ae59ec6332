"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight``.

Forward keeps one fp32 ``rstd`` per row; backward recomputes the normalised row from the input. The weight
gradient is reduced over rows in fp32: each program sums its rows into one partial, then the partials are
summed.
"""

from __future__ import annotations

import torch
from modelpar_kernels.grid import check_device, program_count, row_block, tl, triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., h], weight: [h] -> [..., h]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@triton.jit
def _rms_norm_forward_kernel(
    Y,
    X,
    W,
    RSTD,
    stride_y,
    stride_x,
    n_cols,
    eps,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    x_hat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x_hat * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    DX,
    DY,
    X,
    W,
    RSTD,
    DW_PARTIAL,
    stride_dx,
    stride_dy,
    stride_x,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    first = row_start.to(tl.int64)
    DX += first * stride_dx
    DY += first * stride_dy
    X += first * stride_x
    RSTD += first
    for _ in range(row_start, row_end):
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD)
        x_hat = x * rstd
        dw += dy * x_hat.to(X.dtype.element_ty).to(tl.float32)
        dx_hat = dy * w
        dx = rstd * (dx_hat - x_hat * (tl.sum(dx_hat * x_hat, axis=0) / n_cols))
        tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=mask)
        DX += stride_dx
        DY += stride_dy
        X += stride_x
        RSTD += 1
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


def _rows(t: torch.Tensor, h: int) -> torch.Tensor:
    """[..., h] -> [n, h] with unit column stride (a view when possible)."""
    t = t.reshape(-1, h)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_forward(x, weight, eps):
    """Returns (y [..., h], x2 [n, h], rstd [n]); ``x2`` (x as rows) is what backward reads."""
    shape, h = x.shape, x.shape[-1]
    x2 = _rows(x, h)
    n = x2.shape[0]
    block, num_warps = row_block(h)
    if h > block:
        raise ValueError(f"rms_norm: hidden size {h} is wider than one block ({block}); not supported")
    y = torch.empty((n, h), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    _rms_norm_forward_kernel[(n,)](
        y, x2, weight, rstd, y.stride(0), x2.stride(0), h, eps, BLOCK_SIZE=block, num_warps=num_warps
    )
    return y.view(shape), x2, rstd


def rms_norm_backward(dy, x2, weight, rstd):
    """dy: [..., h]. Returns (dx [n, h], dweight [h])."""
    n, h = x2.shape
    dy2 = _rows(dy, h)
    dx = torch.empty((n, h), dtype=x2.dtype, device=x2.device)
    block, num_warps = row_block(h)
    programs = program_count(x2.device, n)
    rows_per_program = triton.cdiv(n, programs)
    programs = triton.cdiv(n, rows_per_program)
    dw_partial = torch.empty((programs, h), dtype=torch.float32, device=x2.device)
    _rms_norm_backward_kernel[(programs,)](
        dx,
        dy2,
        x2,
        weight,
        rstd,
        dw_partial,
        dx.stride(0),
        dy2.stride(0),
        x2.stride(0),
        n,
        h,
        rows_per_program,
        BLOCK_SIZE=block,
        num_warps=num_warps,
    )
    return dx, dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm; see ``rms_norm_reference`` for the contract."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        check_device(x, weight)
        y, x2, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_backward(dy, x2, weight, rstd)
        return dx.view(ctx.shape), dweight, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm, same contract as ``rms_norm_reference``."""
    return RMSNormFunction.apply(x, weight, eps)
