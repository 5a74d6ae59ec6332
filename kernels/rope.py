"""Rotary position embedding (Llama convention: the two halves of each head are rotated as a pair)."""

from __future__ import annotations

import torch


def rope_tables(
    seq_len: int, head_dim: int, theta: float, offset: int = 0, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [seq_len, head_dim // 2] in fp32 for positions ``offset .. offset + seq_len - 1``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    positions = torch.arange(offset, offset + seq_len, dtype=torch.int64, device=device).float()
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, n_heads, d]; cos, sin: [s, d/2]. Returns the rotated x, same shape and dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
