"""Causal grouped-query attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """q: [b, s, hq, d]; k, v: [b, s, hkv, d] with hq a multiple of hkv. Returns [b, s, hq, d] (torch SDPA)."""
    q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return rearrange(out, "b h s d -> b s h d")
