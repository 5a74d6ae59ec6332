"""Causal grouped-query attention (FlashAttention-2), optionally sliding-window and document-causal, and one block
of it.

Forward streams k/v tiles past a resident q tile with an online softmax in fp32 and saves one log-sum-exp per
query row (base 2, already scaled); backward (``attention_backward``) recomputes the probabilities from it.
Grouped-query attention reads kv head ``q_head // group`` in place (k/v are never repeated in memory); the dk/dv
kernel owns one kv head and sums over the ``group`` q heads that share it, so no atomics are needed.

    q: [b, sq, hq, d]   k: [b, sk, hkv, d]   v: [b, sk, hkv, dv]   group = hq / hkv
    out: [b, sq, hq, dv]   lse: [b, hq, sq] (fp32)   scale: 1/sqrt(d) unless given

q/k and v may have different head dims (``d != dv``: multi-head latent attention's 192 and 128).
A ``window`` W > 0 lets a query see only the W latest positions up to its own (``i + offset - j < W``; see
``attention_tiles``): kv tiles left of a q tile's window are never visited. Document ids (``q_docs`` [b, sq],
``k_docs`` [b, sk], int32) restrict each query to keys of its own document (every tile is then masked). A row
with no visible key (documents, or a window over a block of earlier keys) gets a zero output and lse -inf.
``sq != sk`` is one block of a longer attention (context parallelism: a query chunk against a visiting K/V
chunk), non-causal, ``offset`` being its q chunk's first position minus its k chunk's.
``attention_block_forward`` / ``attention_block_backward`` expose the natural-log lse: the first returns it
for merging partial blocks, the second takes the merged output and lse of the rows (FlashAttention-2's
backward needs nothing else of the other blocks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from modelpar_kernels.attention_backward import attention_backward
from modelpar_kernels.attention_tiles import (
    LN2,
    LOG2E,
    _keep,
    _q_tile,
    _window_tiles,
    check_shapes,
    documents_or_placeholder,
    launch_constants,
    unit_last,
)
from modelpar_kernels.grid import attention_blocks, check_device, tl, triton


def window_keep(sq: int, sk: int, causal: bool, window: int = 0, offset: int = 0, device=None) -> torch.Tensor:
    """Boolean [sq, sk]: key j visible to query i by the causal and window conditions (``attention_tiles``)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    keep = j <= i if causal else torch.ones(sq, sk, dtype=torch.bool, device=device)
    return keep & (i + offset - j < window) if window else keep


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [b, s, hq, d]; k: [b, s, hkv, d]; v: [b, s, hkv, dv] with hq a multiple of hkv. Returns
    [b, s, hq, dv] (torch SDPA); ``window`` W > 0: query i sees keys i-W+1 .. i only."""
    q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if window:
        keep = window_keep(q.shape[2], k.shape[2], causal, window, device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    return rearrange(out, "b h s d -> b s h d")


def attention_math_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention in plain fp32 matmuls for what the flash kernels do not compute: scores s capped by
    ``softcap * tanh(s / softcap)`` (Gemma 2) before the mask, and ``sinks`` [hq] (GPT-OSS: one learned logit
    per head, a column of every row's softmax whose value is zero). q: [b, s, hq, d], k, v: [b, s, hkv, d];
    ``keep``: boolean [sq, sk] or [b, 1, sq, sk], key visible to query. Returns [b, s, hq, d]."""
    q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * _scale(q, scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return rearrange(torch.matmul(probs, v.float()).to(v.dtype), "b h s d -> b s h d")


@triton.jit
def _attention_forward_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_doc,
    k_base,
    v_base,
    kdoc_base,
    stride_ks,
    stride_vs,
    offs_m,
    offs_d,
    offs_dv,
    start,
    end,
    seq_k,
    qk_scale,
    offset,
    window,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over kv tiles ``start .. end``; MASKED tiles may cross the diagonal, the sequence end, the
    window's edge or (HAS_DOCS) a document boundary."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_mask = offs_d[None, :] < HEAD_DIM
        v_mask = offs_dv[None, :] < V_DIM
        if MASKED:
            k_mask = k_mask & (cols[:, None] < seq_k)
            v_mask = v_mask & (cols[:, None] < seq_k)
        rows_k = cols[:, None].to(tl.int64)
        k = tl.load(k_base + rows_k * stride_ks + offs_d[None, :], mask=k_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            k_doc = cols  # unused without documents
            if HAS_DOCS:
                k_doc = tl.load(kdoc_base + cols, mask=cols < seq_k, other=-1)
            keep = (cols[None, :] < seq_k) & _keep(
                offs_m[:, None], cols[None, :], q_doc[:, None], k_doc[None, :], offset, window, CAUSAL, WINDOW, HAS_DOCS
            )
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if HAS_DOCS or WINDOW:  # a row that has seen no visible key yet: keep its terms at exp2(-inf) = 0, never nan
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + rows_k * stride_vs + offs_dv[None, :], mask=v_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attention_forward_kernel(
    OUT,
    LSE,
    Q,
    K,
    V,
    QDOC,
    KDOC,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    seq_q,
    seq_k,
    n_q_heads,
    group,
    qk_scale,
    offset,
    window,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    start_m, bh, b, h, offs_m, offs_d, q_mask, rows, q, k_base, v_base, q_doc = _q_tile(
        Q, K, V, QDOC, stride_qb, stride_qs, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, seq_q,
        n_q_heads, group, HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_D,
    )  # fmt: skip
    offs_dv = tl.arange(0, BLOCK_DV)
    kdoc_base = KDOC
    if HAS_DOCS:
        kdoc_base = KDOC + b * seq_k

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    if CAUSAL:
        # kv tiles left of this q tile are fully visible; the ones on the diagonal need the causal mask.
        unmasked_end = start_m
        end = tl.minimum(start_m + BLOCK_M, seq_k)
    else:
        unmasked_end = (seq_k // BLOCK_N) * BLOCK_N
        end = seq_k
    if HAS_DOCS:  # any tile may cross a document boundary
        unmasked_end = 0
    lo = 0  # no window: every tile from the first, none crossed by a window's edge
    full = 0
    if WINDOW:  # tiles left of every row's window are skipped; those its edge crosses are masked
        lo, full, unmasked_end = _window_tiles(start_m, offset, window, unmasked_end, BLOCK_M, BLOCK_N)
    if WINDOW:
        acc, m_i, l_i = _attention_forward_tiles(
            acc, m_i, l_i, q, q_doc, k_base, v_base, kdoc_base, stride_ks, stride_vs, offs_m, offs_d, offs_dv, lo,
            full, seq_k, qk_scale, offset, window, True, CAUSAL, WINDOW, HAS_DOCS, HEAD_DIM, V_DIM, BLOCK_N,
            DOT_PRECISION,
        )  # fmt: skip
    acc, m_i, l_i = _attention_forward_tiles(
        acc, m_i, l_i, q, q_doc, k_base, v_base, kdoc_base, stride_ks, stride_vs, offs_m, offs_d, offs_dv, full,
        unmasked_end, seq_k, qk_scale, offset, window, False, CAUSAL, WINDOW, HAS_DOCS, HEAD_DIM, V_DIM, BLOCK_N,
        DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attention_forward_tiles(
        acc, m_i, l_i, q, q_doc, k_base, v_base, kdoc_base, stride_ks, stride_vs, offs_m, offs_d, offs_dv,
        unmasked_end, end, seq_k, qk_scale, offset, window, True, CAUSAL, WINDOW, HAS_DOCS, HEAD_DIM, V_DIM,
        BLOCK_N, DOT_PRECISION,
    )  # fmt: skip

    if HAS_DOCS or WINDOW:  # a row with no visible key: zero output, lse -inf (it adds nothing when merged)
        seen = l_i > 0
        l_i = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, m_i + tl.math.log2(l_i), float("-inf"))
    else:
        lse = m_i + tl.math.log2(l_i)
    out = acc / l_i[:, None]
    out_mask = (offs_m[:, None] < seq_q) & (offs_dv[None, :] < V_DIM)
    out_ptrs = OUT + b * stride_ob + h * stride_oh + rows * stride_os + offs_dv[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)
    tl.store(LSE + bh.to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def attention_forward(q, k, v, causal, q_docs=None, k_docs=None, window: int = 0, offset: int = 0, scale=None):
    """Returns (out [b, sq, hq, dv], lse [b, hq, sq] fp32, base-2 log-sum-exp of the scaled scores)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qdoc, kdoc, has_docs = documents_or_placeholder(q, q_docs, k_docs)
    out = q.new_empty((b, sq, hq, v.shape[-1]))
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    tiles = attention_blocks(max(d, v.shape[-1]), q.device, q.dtype)["forward"]
    grid = (triton.cdiv(sq, tiles["BLOCK_M"]), b * hq)
    _attention_forward_kernel[grid](
        out, lse, q, k, v, qdoc, kdoc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        sq, sk, hq, hq // hkv, LOG2E * _scale(q, scale), offset, window,
        CAUSAL=causal, WINDOW=window > 0, HAS_DOCS=has_docs, **launch_constants(q, v), **tiles,
    )  # fmt: skip
    return out, lse


class FlashAttentionFunction(torch.autograd.Function):
    """Triton flash attention; see ``attention_reference`` for the contract (``documents``: ids [b, s] or None)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, documents=None, window=0, scale=None):
        check_device(q, k, v)
        check_shapes(q, k, v, causal, documents, documents, window)
        q, k, v = unit_last(q), unit_last(k), unit_last(v)
        out, lse = attention_forward(q, k, v, causal, documents, documents, window, 0, scale)
        ctx.save_for_backward(q, k, v, out, lse, *(() if documents is None else (documents,)))
        ctx.causal, ctx.window, ctx.scale = causal, window, _scale(q, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *documents = ctx.saved_tensors
        docs = documents[0] if documents else None
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.causal, docs, docs, ctx.window, 0, ctx.scale)
        return dq, dk, dv, None, None, None, None


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    documents: torch.Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Triton flash attention, same contract as ``attention_reference`` (scale 1/sqrt(d) unless given);
    ``documents`` [b, s]: a query sees only keys of its own document; ``window`` W > 0: only the W latest."""
    return FlashAttentionFunction.apply(q, k, v, causal, documents, window, scale)


def attention_block_forward(q, k, v, causal: bool, q_docs=None, k_docs=None, window: int = 0, offset: int = 0):
    """One block of attention, no autograd: q [b, sq, hq, d] against k [b, sk, hkv, d], v [b, sk, hkv, dv] ->
    (out [b, sq, hq, dv], lse [b, hq, sq] fp32, natural log; -inf where a row sees no key). ``causal`` needs
    sq == sk (the block on the diagonal); ``q_docs`` [b, sq], ``k_docs`` [b, sk]: document ids, a query sees
    keys of its own only; ``window`` W > 0 with ``offset`` (q's first position minus k's): only keys less than
    W positions back."""
    check_device(q, k, v)
    check_shapes(q, k, v, causal, q_docs, k_docs, window, offset)
    out, lse = attention_forward(unit_last(q), unit_last(k), unit_last(v), causal, q_docs, k_docs, window, offset)
    return out, lse * LN2


def attention_block_backward(
    dout, q, k, v, out, lse, causal: bool, q_docs=None, k_docs=None, window: int = 0, offset: int = 0
):
    """Gradients (dq, dk, dv) of one block, given the rows' *merged* output and natural-log lse (over every
    block they attend to): each block's share of FlashAttention-2's backward, summed by the caller."""
    check_device(q, k, v)
    check_shapes(q, k, v, causal, q_docs, k_docs, window, offset)
    q, k, v, out = unit_last(q), unit_last(k), unit_last(v), unit_last(out)
    return attention_backward(dout, q, k, v, out, lse * LOG2E, causal, q_docs, k_docs, window, offset)
