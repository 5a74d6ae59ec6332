"""Rotary position embedding (Llama convention: the two halves of each head are rotated as a pair).

One program rotates every head of one token, reading that token's row of the cos/sin tables once. Backward is
the same rotation by the opposite angle. Position offsets (a sequence chunk starting at position p) come from
the tables: build them with ``rope_tables(s, d, theta, offset=p)``.
"""

from __future__ import annotations

import torch
from modelpar_kernels.grid import check_device, tl, triton


def rope_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    offset: int = 0,
    device=None,
    *,
    inv_freq: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [seq_len, head_dim // 2] in fp32 for positions ``offset .. offset + seq_len - 1``.

    ``inv_freq`` [head_dim // 2]: frequencies to use instead of theta's (a scaled RoPE: linear, Llama 3, YaRN);
    ``scale``: cos and sin multiplied by it (YaRN's attention factor). The rotation kernels take any tables: a
    scaled rotation's transpose is still the same tables with sin negated."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    elif inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must be [{head_dim // 2}] for head dim {head_dim}, got {tuple(inv_freq.shape)}")
    inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    positions = torch.arange(offset, offset + seq_len, dtype=torch.int64, device=device).float()
    angles = torch.outer(positions, inv_freq)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, n_heads, d]; cos, sin: [s, d/2]. Returns the rotated x, same shape and dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


@triton.jit
def _rope_kernel(
    Y,
    X,
    COS,
    SIN,
    seq_len,
    n_heads,
    half,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_yb,
    stride_ys,
    stride_yh,
    stride_cos,
    stride_sin,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # b * seq_len + position
    b = token // seq_len
    pos = token % seq_len
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < half)
    cos = tl.load(COS + pos * stride_cos + dims, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_sin + dims, mask=dims < half, other=0.0).to(tl.float32)
    if BACKWARD:
        sin = -sin  # the transpose of a rotation is the rotation by the opposite angle
    x_row = X + b * stride_xb + pos * stride_xs + heads * stride_xh + dims
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half, mask=mask, other=0.0).to(tl.float32)
    y_row = Y + b * stride_yb + pos * stride_ys + heads * stride_yh + dims
    tl.store(y_row, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + half, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """Launch the rotation: x [b, s, n_heads, d] (any strides with a unit last one) -> a new contiguous tensor."""
    b, s, n_heads, d = x.shape
    if d % 2:
        raise ValueError(f"RoPE needs an even head dim, got {d}")
    if cos.shape != (s, d // 2) or sin.shape != (s, d // 2):
        raise ValueError(f"cos/sin must be [{s}, {d // 2}] for x {tuple(x.shape)}, got {tuple(cos.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    y = torch.empty((b, s, n_heads, d), dtype=x.dtype, device=x.device)
    _rope_kernel[(b * s,)](
        y,
        x,
        cos,
        sin,
        s,
        n_heads,
        d // 2,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        cos.stride(0),
        sin.stride(0),
        BACKWARD=backward,
        BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_D=triton.next_power_of_2(d // 2),
    )
    return y


class RoPEFunction(torch.autograd.Function):
    """Triton RoPE; see ``apply_rope_reference`` for the contract. cos/sin are constants (no gradient)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        check_device(x, cos, sin)
        ctx.save_for_backward(cos, sin)
        return rope_rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return rope_rotate(dy, cos, sin, backward=True), None, None


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton RoPE, same contract as ``apply_rope_reference`` (use it on q and on k)."""
    return RoPEFunction.apply(x, cos, sin)
