"""Causal grouped-query attention (FlashAttention-2), optionally document-causal, and one block of it.

Forward streams k/v tiles past a resident q tile with an online softmax in fp32 and saves one log-sum-exp per
query row (base 2, already scaled); backward recomputes the probabilities from it. Grouped-query attention
reads kv head ``q_head // group`` in place (k/v are never repeated in memory); the dk/dv kernel owns one kv
head and sums over the ``group`` q heads that share it, so no atomics are needed.

    q: [b, sq, hq, d]   k, v: [b, sk, hkv, d]   group = hq / hkv   out: [b, sq, hq, d]   lse: [b, hq, sq] (fp32)

Document ids (``q_docs`` [b, sq], ``k_docs`` [b, sk], int32) restrict each query to keys of its own document
(every tile is then masked; a row with no visible key gets a zero output and lse -inf). ``sq != sk`` is one
block of a longer attention (context parallelism: a query chunk against a visiting K/V chunk), non-causal.
``attention_block_forward`` / ``attention_block_backward`` expose the natural-log lse: the first returns it
for merging partial blocks, the second takes the merged output and lse of the rows (FlashAttention-2's
backward needs nothing else of the other blocks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from modelpar_kernels.grid import attention_blocks, check_device, tl, triton

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """q: [b, s, hq, d]; k, v: [b, s, hkv, d] with hq a multiple of hkv. Returns [b, s, hq, d] (torch SDPA)."""
    q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return rearrange(out, "b h s d -> b s h d")


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
    start,
    end,
    seq_k,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over kv tiles ``start .. end``; MASKED tiles may cross the diagonal, the sequence end or
    (HAS_DOCS) a document boundary."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_mask = offs_d[None, :] < HEAD_DIM
        if MASKED:
            kv_mask = kv_mask & (cols[:, None] < seq_k)
        rows_k = cols[:, None].to(tl.int64)
        k = tl.load(k_base + rows_k * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            keep = cols[None, :] < seq_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            if HAS_DOCS:
                k_doc = tl.load(kdoc_base + cols, mask=cols < seq_k, other=-1)
                keep = keep & (k_doc[None, :] == q_doc[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if HAS_DOCS:  # a row that has seen no visible key yet: keep its terms at exp2(-inf) = 0, never nan
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + rows_k * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


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
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    start_m, bh, b, h, offs_m, offs_d, row_mask, rows, q, k_base, v_base, q_doc = _q_tile(
        Q, K, V, QDOC, stride_qb, stride_qs, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, seq_q,
        n_q_heads, group, HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_D,
    )  # fmt: skip
    kdoc_base = KDOC
    if HAS_DOCS:
        kdoc_base = KDOC + b * seq_k

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if CAUSAL:
        # kv tiles left of this q tile are fully visible; the ones on the diagonal need the causal mask.
        unmasked_end = start_m
        end = tl.minimum(start_m + BLOCK_M, seq_k)
    else:
        unmasked_end = (seq_k // BLOCK_N) * BLOCK_N
        end = seq_k
    if HAS_DOCS:  # any tile may cross a document boundary
        unmasked_end = 0
    acc, m_i, l_i = _attention_forward_tiles(
        acc, m_i, l_i, q, q_doc, k_base, v_base, kdoc_base, stride_ks, stride_vs, offs_m, offs_d, 0,
        unmasked_end, seq_k, qk_scale, False, CAUSAL, HAS_DOCS, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attention_forward_tiles(
        acc, m_i, l_i, q, q_doc, k_base, v_base, kdoc_base, stride_ks, stride_vs, offs_m, offs_d, unmasked_end,
        end, seq_k, qk_scale, True, CAUSAL, HAS_DOCS, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip

    if HAS_DOCS:  # a row with no visible key: zero output, lse -inf (it adds nothing when merged)
        seen = l_i > 0
        l_i = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, m_i + tl.math.log2(l_i), float("-inf"))
    else:
        lse = m_i + tl.math.log2(l_i)
    out = acc / l_i[:, None]
    out_ptrs = OUT + b * stride_ob + h * stride_oh + rows * stride_os + offs_d[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=row_mask)
    tl.store(LSE + bh.to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)


@triton.jit
def _attention_backward_delta_kernel(
    DELTA,
    OUT,
    DOUT,
    stride_ob,
    stride_os,
    stride_oh,
    stride_dob,
    stride_dos,
    stride_doh,
    seq_len,
    n_q_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta[b, h, i] = sum_d out * dout: the row term of the softmax backward."""
    bh = tl.program_id(1)
    b = (bh // n_q_heads).to(tl.int64)
    h = (bh % n_q_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(OUT + b * stride_ob + h * stride_oh + rows * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DOUT + b * stride_dob + h * stride_doh + rows * stride_dos + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * seq_len + offs_m, delta, mask=offs_m < seq_len)


@triton.jit
def _attention_backward_kv_kernel(
    DK,
    DV,
    Q,
    K,
    V,
    DOUT,
    LSE,
    DELTA,
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
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    seq_q,
    seq_k,
    n_kv_heads,
    group,
    sm_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One kv tile of one kv head: dk, dv summed over every q tile that sees it, in each of the group's q heads."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = (bh // n_kv_heads).to(tl.int64)
    kv_h = bh % n_kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM)
    k_doc = offs_n  # unused without documents
    if HAS_DOCS:
        k_doc = tl.load(KDOC + b * seq_k + offs_n, mask=offs_n < seq_k, other=-1)
    rows_n = offs_n[:, None].to(tl.int64)
    k_ptrs = K + b * stride_kb + kv_h.to(tl.int64) * stride_kh + rows_n * stride_ks + offs_d[None, :]
    v_ptrs = V + b * stride_vb + kv_h.to(tl.int64) * stride_vh + rows_n * stride_vs + offs_d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # Causal: q tiles above this kv tile's first row cannot see it.
    first_m = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for g in range(0, group):
        h = (kv_h * group + g).to(tl.int64)
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DOUT + b * stride_dob + h * stride_doh
        row_base = (b * n_kv_heads * group + h) * seq_q  # into lse / delta: [b, hq, sq]
        for start_m in range(first_m, seq_q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
            rows_m = offs_m[:, None].to(tl.int64)
            q = tl.load(q_base + rows_m * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + rows_m * stride_dos + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
            qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            keep = (offs_n[:, None] < seq_k) & (offs_m[None, :] < seq_q)
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :])
            if HAS_DOCS:
                q_doc = tl.load(QDOC + b * seq_q + offs_m, mask=offs_m < seq_q, other=-2)
                keep = keep & (k_doc[:, None] == q_doc[None, :])
            p_t = tl.where(keep, tl.math.exp2(qk_t * qk_scale - lse[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    dk_ptrs = DK + b * stride_dkb + kv_h.to(tl.int64) * stride_dkh + rows_n * stride_dks + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + kv_h.to(tl.int64) * stride_dvh + rows_n * stride_dvs + offs_d[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attention_backward_q_kernel(
    DQ,
    Q,
    K,
    V,
    DOUT,
    LSE,
    DELTA,
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
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    seq_q,
    seq_k,
    n_q_heads,
    group,
    sm_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One q tile of one q head: dq summed over the kv tiles it sees."""
    start_m, bh, b, h, offs_m, offs_d, q_mask, rows_m, q, k_base, v_base, q_doc = _q_tile(
        Q, K, V, QDOC, stride_qb, stride_qs, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, seq_q,
        n_q_heads, group, HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_D,
    )  # fmt: skip
    do = tl.load(DOUT + b * stride_dob + h * stride_doh + rows_m * stride_dos + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_q + offs_m, mask=offs_m < seq_q, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * seq_q + offs_m, mask=offs_m < seq_q, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end = tl.minimum(start_m + BLOCK_M, seq_k) if CAUSAL else seq_k
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM)
        rows_n = offs_n[:, None].to(tl.int64)
        k = tl.load(k_base + rows_n * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows_n * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        keep = (offs_m[:, None] < seq_q) & (offs_n[None, :] < seq_k)
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if HAS_DOCS:
            k_doc = tl.load(KDOC + b * seq_k + offs_n, mask=offs_n < seq_k, other=-1)
            keep = keep & (k_doc[None, :] == q_doc[:, None])
        p = tl.where(keep, tl.math.exp2(qk * qk_scale - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows_m * stride_dqs + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_constants(q: torch.Tensor) -> dict:
    d = q.shape[-1]
    return {
        "HEAD_DIM": d,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),  # tl.dot needs at least 16
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",  # fp32 in, full fp32 products
    }


def _documents(q, q_docs, k_docs):
    """(QDOC, KDOC, HAS_DOCS): int32 contiguous document ids, or q itself as an unused pointer."""
    if q_docs is None:
        return q, q, False
    return q_docs.to(torch.int32).contiguous(), k_docs.to(torch.int32).contiguous(), True


def attention_forward(q, k, v, causal, q_docs=None, k_docs=None):
    """Returns (out [b, sq, hq, d], lse [b, hq, sq] fp32, base-2 log-sum-exp of the scaled scores)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qdoc, kdoc, has_docs = _documents(q, q_docs, k_docs)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    tiles = attention_blocks(d, q.device, q.dtype)["forward"]
    grid = (triton.cdiv(sq, tiles["BLOCK_M"]), b * hq)
    _attention_forward_kernel[grid](
        out, lse, q, k, v, qdoc, kdoc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        sq, sk, hq, hq // hkv, LOG2E / math.sqrt(d),
        CAUSAL=causal, HAS_DOCS=has_docs, **_launch_constants(q), **tiles,
    )  # fmt: skip
    return out, lse


def attention_backward(dout, q, k, v, out, lse, causal, q_docs=None, k_docs=None):
    """Returns (dq, dk, dv) in the shapes of q, k, v; ``lse`` base 2 as ``attention_forward`` returns it."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qdoc, kdoc, has_docs = _documents(q, q_docs, k_docs)
    dout = _unit_last(dout)
    lse = lse.contiguous()
    constants = _launch_constants(q)
    tiles = attention_blocks(d, q.device, q.dtype)
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    _attention_backward_delta_kernel[(triton.cdiv(sq, 64), b * hq)](
        delta, out, dout,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        sq, hq, HEAD_DIM=d, BLOCK_M=64, BLOCK_D=constants["BLOCK_D"],
    )  # fmt: skip
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    sm_scale = 1.0 / math.sqrt(d)
    kv_tiles = tiles["backward_kv"]
    _attention_backward_kv_kernel[(triton.cdiv(sk, kv_tiles["BLOCK_N"]), b * hkv)](
        dk, dv, q, k, v, dout, lse, delta, qdoc, kdoc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        sq, sk, hkv, hq // hkv, sm_scale, sm_scale * LOG2E,
        CAUSAL=causal, HAS_DOCS=has_docs, **constants, **kv_tiles,
    )  # fmt: skip
    q_tiles = tiles["backward_q"]
    _attention_backward_q_kernel[(triton.cdiv(sq, q_tiles["BLOCK_M"]), b * hq)](
        dq, q, k, v, dout, lse, delta, qdoc, kdoc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        sq, sk, hq, hq // hkv, sm_scale, sm_scale * LOG2E,
        CAUSAL=causal, HAS_DOCS=has_docs, **constants, **q_tiles,
    )  # fmt: skip
    return dq, dk, dv


def _check_shapes(q, k, v, causal, q_docs, k_docs):
    b, sq, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % k.shape[2] or (causal and k.shape[1] != sq):
        raise ValueError(
            f"attention: q {tuple(q.shape)} needs k, v of shape [{b}, {sq if causal else 'sk'}, hkv, {d}] with hkv "
            f"dividing {hq}; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if (q_docs is None) != (k_docs is None) or (
        q_docs is not None and (tuple(q_docs.shape) != (b, sq) or tuple(k_docs.shape) != (b, k.shape[1]))
    ):
        raise ValueError(f"attention: document ids must be given for both q [{b}, {sq}] and k [{b}, {k.shape[1]}]")


class FlashAttentionFunction(torch.autograd.Function):
    """Triton flash attention; see ``attention_reference`` for the contract (``documents``: ids [b, s] or None)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, documents=None):
        check_device(q, k, v)
        _check_shapes(q, k, v, causal, documents, documents)
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        out, lse = attention_forward(q, k, v, causal, documents, documents)
        ctx.save_for_backward(q, k, v, out, lse, *(() if documents is None else (documents,)))
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *documents = ctx.saved_tensors
        docs = documents[0] if documents else None
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.causal, docs, docs)
        return dq, dk, dv, None, None


def attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton flash attention, same contract as ``attention_reference`` (scale 1/sqrt(d)); ``documents`` [b, s]:
    a query sees only keys of its own document."""
    return FlashAttentionFunction.apply(q, k, v, causal, documents)


def attention_block_forward(q, k, v, causal: bool, q_docs=None, k_docs=None):
    """One block of attention, no autograd: q [b, sq, hq, d] against k, v [b, sk, hkv, d] -> (out [b, sq, hq, d],
    lse [b, hq, sq] fp32, natural log; -inf where a row sees no key). ``causal`` needs sq == sk (the block on
    the diagonal); ``q_docs`` [b, sq], ``k_docs`` [b, sk]: document ids, a query sees keys of its own only."""
    check_device(q, k, v)
    _check_shapes(q, k, v, causal, q_docs, k_docs)
    out, lse = attention_forward(_unit_last(q), _unit_last(k), _unit_last(v), causal, q_docs, k_docs)
    return out, lse * LN2


def attention_block_backward(dout, q, k, v, out, lse, causal: bool, q_docs=None, k_docs=None):
    """Gradients (dq, dk, dv) of one block, given the rows' *merged* output and natural-log lse (over every
    block they attend to): each block's share of FlashAttention-2's backward, summed by the caller."""
    check_device(q, k, v)
    _check_shapes(q, k, v, causal, q_docs, k_docs)
    q, k, v, out = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(out)
    return attention_backward(dout, q, k, v, out, lse * LOG2E, causal, q_docs, k_docs)
