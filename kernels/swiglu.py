"""SwiGLU gate: ``silu(gate) * up``.

Forward stores nothing but its inputs; backward recomputes ``sigmoid(gate)`` instead of keeping it, so the op
costs no activation memory beyond what the projections already hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from modelpar_kernels.grid import check_device, row_block, tl, triton


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., f]. Returns silu(gate) * up."""
    return F.silu(gate) * up


@triton.jit
def _swiglu_forward_kernel(OUT, GATE, UP, stride_out, stride_gate, stride_up, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    gate = tl.load(GATE + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate * tl.sigmoid(gate)
    tl.store(OUT + row * stride_out + cols, (silu * up).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    DGATE,
    DUP,
    DOUT,
    GATE,
    UP,
    stride_dgate,
    stride_dup,
    stride_dout,
    stride_gate,
    stride_up,
    n_cols,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    dout = tl.load(DOUT + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(GATE + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(DGATE + row * stride_dgate + cols, dgate.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + row * stride_dup + cols, (dout * silu).to(DUP.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, f: int) -> torch.Tensor:
    """[..., f] -> [n, f] with unit column stride (a view when possible, e.g. a slice of a fused projection)."""
    t = t.reshape(-1, f)
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int]:
    """One program per (row, block of columns): rows can be wide (the MLP's hidden size)."""
    block, num_warps = row_block(n_cols, max_block=4096)
    return (n_rows, triton.cdiv(n_cols, block)), block, num_warps


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., f] (any row strides) -> silu(gate) * up, a new contiguous [..., f]."""
    shape, f = gate.shape, gate.shape[-1]
    gate2, up2 = _rows(gate, f), _rows(up, f)
    out = torch.empty(gate2.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    grid, block, num_warps = _grid(*gate2.shape)
    _swiglu_forward_kernel[grid](
        out, gate2, up2, out.stride(0), gate2.stride(0), up2.stride(0), f, BLOCK_SIZE=block, num_warps=num_warps
    )
    return out.view(shape)


def swiglu_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) for the output gradient ``dout``, recomputing sigmoid(gate)."""
    f = gate.shape[-1]
    gate2, up2, dout2 = _rows(gate, f), _rows(up, f), _rows(dout, f)
    dgate = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up2.shape, dtype=up.dtype, device=up.device)
    grid, block, num_warps = _grid(*gate2.shape)
    _swiglu_backward_kernel[grid](
        dgate,
        dup,
        dout2,
        gate2,
        up2,
        dgate.stride(0),
        dup.stride(0),
        dout2.stride(0),
        gate2.stride(0),
        up2.stride(0),
        f,
        BLOCK_SIZE=block,
        num_warps=num_warps,
    )
    return dgate.view(gate.shape), dup.view(up.shape)


class SwiGLUFunction(torch.autograd.Function):
    """Triton SwiGLU; see ``swiglu_reference`` for the contract."""

    @staticmethod
    def forward(ctx, gate, up):
        check_device(gate, up)
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dout, gate, up)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton SwiGLU, same contract as ``swiglu_reference``."""
    return SwiGLUFunction.apply(gate, up)
