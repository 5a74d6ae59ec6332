"""What the flash-attention kernels share: which keys a query sees, which kv tiles can hold such keys, the q tile a
program starts from, and the host-side checks and launch constants.

A query at row ``i`` of q sees a key at row ``j`` of k when every one of these holds:

- ``j < sk`` (and ``i < sq``);
- causal (the block on the diagonal, ``sq == sk``): ``j <= i``;
- a window ``W > 0``: ``i + offset - j < W``, where ``offset`` is the position of q's first row minus that of
  k's first row (0 on the diagonal; a context-parallel block of earlier keys has ``offset > 0``): the ``W``
  latest positions up to and including the query's own, as transformers' sliding-window mask;
- documents: ``q_doc[i] == k_doc[j]``.

With a window, kv tiles wholly left of every row's window are never visited (loop bounds), tiles wholly inside
it run unmasked, and only the tiles the window's edge crosses are masked.
"""

from __future__ import annotations

import torch
from modelpar_kernels.grid import tl, triton

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _keep(rows, cols, q_doc, k_doc, offset, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Visibility of keys ``cols`` to queries ``rows`` (both broadcast to one 2-D shape; sequence bounds are the
    caller's): causal, window and document conditions of the module docstring."""
    keep = cols == cols
    if CAUSAL:
        keep = keep & (cols <= rows)
    if WINDOW:
        keep = keep & (rows + offset - cols < window)
    if HAS_DOCS:
        keep = keep & (k_doc == q_doc)
    return keep


@triton.jit
def _window_tiles(start_m, offset, window, unmasked_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, full, unmasked_end) for the q tile at ``start_m``: kv tiles before ``lo`` are left of every row's
    window (never visited); ``lo .. full`` are crossed by the window's edge (masked); ``full .. unmasked_end``
    are inside every row's window (unmasked, as far as the caller's causal/sequence bound allows)."""
    first = tl.maximum(start_m + offset - window + 1, 0)  # the lowest key in the window of the tile's first row
    lo = (first // BLOCK_N) * BLOCK_N
    unmasked_end = tl.maximum(unmasked_end, lo)
    inside = tl.maximum(start_m + BLOCK_M + offset - window, 0)  # keys from here are in every row's window
    full = tl.minimum(tl.maximum(((inside + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), unmasked_end)
    return lo, full, unmasked_end


@triton.jit
def _q_tile(
    Q,
    K,
    V,
    QDOC,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    seq_q,
    n_q_heads,
    group,
    HAS_DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """What a program owning one q tile of one q head starts from (forward and dq backward): its batch and head,
    row offsets and mask, the q tile, the bases of its kv head's k and v, and the rows' document ids."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    kv_h = (h // group).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    q_doc = offs_m  # unused without documents
    if HAS_DOCS:
        q_doc = tl.load(QDOC + b * seq_q + offs_m, mask=offs_m < seq_q, other=-2)
    return start_m, bh, b, h, offs_m, offs_d, q_mask, rows, q, k_base, v_base, q_doc


def unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def launch_constants(q: torch.Tensor, v: torch.Tensor) -> dict:
    """Head dims of q/k (``HEAD_DIM``) and of v (``V_DIM``), their power-of-two tiles, the dot precision."""
    d, dv = q.shape[-1], v.shape[-1]
    return {
        "HEAD_DIM": d,
        "V_DIM": dv,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),  # tl.dot needs at least 16
        "BLOCK_DV": max(16, triton.next_power_of_2(dv)),
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",  # fp32 in, full fp32 products
    }


def documents_or_placeholder(q, q_docs, k_docs):
    """(QDOC, KDOC, HAS_DOCS): int32 contiguous document ids, or q itself as an unused pointer."""
    if q_docs is None:
        return q, q, False
    return q_docs.to(torch.int32).contiguous(), k_docs.to(torch.int32).contiguous(), True


def check_shapes(q, k, v, causal, q_docs, k_docs, window: int = 0, offset: int = 0) -> None:
    """One line naming what is wrong with the shapes, the document ids or the window of an attention call."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if (
        k.dim() != 4
        or v.dim() != 4
        or k.shape[0] != b
        or k.shape[3] != d
        or tuple(v.shape[:3]) != (b, sk, hkv)
        or hq % hkv
        or (causal and sk != sq)
    ):
        raise ValueError(
            f"attention: q {tuple(q.shape)} needs k [{b}, {sq if causal else 'sk'}, hkv, {d}] and v [{b}, "
            f"{sq if causal else 'sk'}, hkv, dv] with hkv dividing {hq}; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if (q_docs is None) != (k_docs is None) or (
        q_docs is not None and (tuple(q_docs.shape) != (b, sq) or tuple(k_docs.shape) != (b, sk))
    ):
        raise ValueError(f"attention: document ids must be given for both q [{b}, {sq}] and k [{b}, {sk}]")
    if window < 0 or (causal and offset):
        raise ValueError(
            f"attention: window={window} must be >= 0 (0: none) and offset={offset} is 0 on the causal diagonal"
        )
