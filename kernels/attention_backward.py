"""Flash attention's backward (FlashAttention-2): the row term ``delta``, then dk/dv per kv tile and dq per q tile,
each recomputing the probabilities from the forward's base-2 log-sum-exp.

Shapes and masks as ``modelpar_kernels.attention`` (q, k: head dim d; v, out: dv; causal, window with its
``offset``, documents: ``modelpar_kernels.attention_tiles``). Under a window the dk/dv kernel visits only the q
tiles whose rows can reach its kv tile, and the dq kernel only the kv tiles inside its rows' windows.
"""

from __future__ import annotations

import math

import torch
from modelpar_kernels.attention_tiles import (
    LOG2E,
    _keep,
    _q_tile,
    documents_or_placeholder,
    launch_constants,
    unit_last,
)
from modelpar_kernels.grid import attention_blocks, tl, triton


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
    """delta[b, h, i] = sum_d out * dout: the row term of the softmax backward (``HEAD_DIM``: v's head dim)."""
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
    """One kv tile of one kv head: dk, dv summed over every q tile that sees it, in each of the group's q heads."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = (bh // n_kv_heads).to(tl.int64)
    kv_h = bh % n_kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM)
    v_mask = (offs_n[:, None] < seq_k) & (offs_dv[None, :] < V_DIM)
    k_doc = offs_n  # unused without documents
    if HAS_DOCS:
        k_doc = tl.load(KDOC + b * seq_k + offs_n, mask=offs_n < seq_k, other=-1)
    rows_n = offs_n[:, None].to(tl.int64)
    k_ptrs = K + b * stride_kb + kv_h.to(tl.int64) * stride_kh + rows_n * stride_ks + offs_d[None, :]
    v_ptrs = V + b * stride_vb + kv_h.to(tl.int64) * stride_vh + rows_n * stride_vs + offs_dv[None, :]
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    # Causal: q tiles above this kv tile's first row cannot see it; a window: nor rows W or more past its last.
    first_m = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    end_m = seq_q
    if WINDOW:
        end_m = tl.minimum(seq_q, start_n + BLOCK_N - 1 + window - offset)
    for g in range(0, group):
        h = (kv_h * group + g).to(tl.int64)
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DOUT + b * stride_dob + h * stride_doh
        row_base = (b * n_kv_heads * group + h) * seq_q  # into lse / delta: [b, hq, sq]
        for start_m in range(first_m, end_m, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
            do_mask = (offs_m[:, None] < seq_q) & (offs_dv[None, :] < V_DIM)
            rows_m = offs_m[:, None].to(tl.int64)
            q = tl.load(q_base + rows_m * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + rows_m * stride_dos + offs_dv[None, :], mask=do_mask, other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
            qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            q_doc = offs_m  # unused without documents
            if HAS_DOCS:
                q_doc = tl.load(QDOC + b * seq_q + offs_m, mask=offs_m < seq_q, other=-2)
            keep = (offs_n[:, None] < seq_k) & (offs_m[None, :] < seq_q)
            keep = keep & _keep(
                offs_m[None, :], offs_n[:, None], q_doc[None, :], k_doc[:, None], offset, window, CAUSAL, WINDOW,
                HAS_DOCS,
            )  # fmt: skip
            p_t = tl.where(keep, tl.math.exp2(qk_t * qk_scale - lse[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    dk_ptrs = DK + b * stride_dkb + kv_h.to(tl.int64) * stride_dkh + rows_n * stride_dks + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + kv_h.to(tl.int64) * stride_dvh + rows_n * stride_dvs + offs_dv[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=v_mask)


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
    """One q tile of one q head: dq summed over the kv tiles it sees."""
    start_m, bh, b, h, offs_m, offs_d, q_mask, rows_m, q, k_base, v_base, q_doc = _q_tile(
        Q, K, V, QDOC, stride_qb, stride_qs, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, seq_q,
        n_q_heads, group, HAS_DOCS, HEAD_DIM, BLOCK_M, BLOCK_D,
    )  # fmt: skip
    offs_dv = tl.arange(0, BLOCK_DV)
    do_mask = (offs_m[:, None] < seq_q) & (offs_dv[None, :] < V_DIM)
    do = tl.load(
        DOUT + b * stride_dob + h * stride_doh + rows_m * stride_dos + offs_dv[None, :], mask=do_mask, other=0.0
    )
    lse = tl.load(LSE + bh.to(tl.int64) * seq_q + offs_m, mask=offs_m < seq_q, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * seq_q + offs_m, mask=offs_m < seq_q, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end = tl.minimum(start_m + BLOCK_M, seq_k) if CAUSAL else seq_k
    lo = 0
    if WINDOW:  # kv tiles left of the first row's window are never visited
        lo = (tl.maximum(start_m + offset - window + 1, 0) // BLOCK_N) * BLOCK_N
    for start_n in range(lo, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM)
        v_mask = (offs_n[:, None] < seq_k) & (offs_dv[None, :] < V_DIM)
        rows_n = offs_n[:, None].to(tl.int64)
        k = tl.load(k_base + rows_n * stride_ks + offs_d[None, :], mask=k_mask, other=0.0)
        v = tl.load(v_base + rows_n * stride_vs + offs_dv[None, :], mask=v_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        k_doc = offs_n  # unused without documents
        if HAS_DOCS:
            k_doc = tl.load(KDOC + b * seq_k + offs_n, mask=offs_n < seq_k, other=-1)
        keep = (offs_m[:, None] < seq_q) & (offs_n[None, :] < seq_k)
        keep = keep & _keep(
            offs_m[:, None], offs_n[None, :], q_doc[:, None], k_doc[None, :], offset, window, CAUSAL, WINDOW, HAS_DOCS
        )
        p = tl.where(keep, tl.math.exp2(qk * qk_scale - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows_m * stride_dqs + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def attention_backward(
    dout, q, k, v, out, lse, causal, q_docs=None, k_docs=None, window: int = 0, offset: int = 0, scale=None
):
    """Returns (dq, dk, dv) in the shapes of q, k, v; ``lse`` base 2 as ``attention_forward`` returns it;
    ``scale``: the forward's (1/sqrt(d) unless given)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qdoc, kdoc, has_docs = documents_or_placeholder(q, q_docs, k_docs)
    dout = unit_last(dout)
    lse = lse.contiguous()
    constants = launch_constants(q, v)
    tiles = attention_blocks(max(d, v.shape[-1]), q.device, q.dtype)
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    _attention_backward_delta_kernel[(triton.cdiv(sq, 64), b * hq)](
        delta, out, dout,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        sq, hq, HEAD_DIM=v.shape[-1], BLOCK_M=64, BLOCK_D=constants["BLOCK_DV"],
    )  # fmt: skip
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    masks = dict(CAUSAL=causal, WINDOW=window > 0, HAS_DOCS=has_docs)
    kv_tiles = tiles["backward_kv"]
    _attention_backward_kv_kernel[(triton.cdiv(sk, kv_tiles["BLOCK_N"]), b * hkv)](
        dk, dv, q, k, v, dout, lse, delta, qdoc, kdoc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        sq, sk, hkv, hq // hkv, sm_scale, sm_scale * LOG2E, offset, window,
        **masks, **constants, **kv_tiles,
    )  # fmt: skip
    q_tiles = tiles["backward_q"]
    _attention_backward_q_kernel[(triton.cdiv(sq, q_tiles["BLOCK_M"]), b * hq)](
        dq, q, k, v, dout, lse, delta, qdoc, kdoc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        sq, sk, hq, hq // hkv, sm_scale, sm_scale * LOG2E, offset, window,
        **masks, **constants, **q_tiles,
    )  # fmt: skip
    return dq, dk, dv
