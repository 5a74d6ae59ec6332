"""One block of attention with its log-sum-exp, on each backend: what context parallelism merges block by block.

A block is queries q [b, hq, sq, d] against keys k [b, hkv, sk, d] and values v [b, hkv, sk, dv] (the
sequence-second layout of the engine's attention; ``hq`` a multiple of ``hkv``; ``dv`` may differ from ``d``),
masked by a ``BlockMask``. Forward returns the block's
output and its natural-log lse (fp32 or wider), so partial blocks can be merged; backward takes the rows'
*merged* output and lse (FlashAttention-2's backward needs nothing else of the other blocks) and returns the
block's share of dq, dk, dv. Three ways to compute it, chosen by ``backend``:

- "triton": the flash kernel of ``modelpar_kernels.attention`` (document masks as ids, no boolean mask);
- "torch" on CPU: aten's flash attention for CPU, which returns the lse with the output (equal head dims);
- "torch" elsewhere, or with ``dv != d``, or with a soft-cap: plain matmuls in the accumulation dtype.

A ``softcap`` c > 0 caps each score s (after scaling) by ``c * tanh(s / c)`` before the mask and softmax (Gemma 2);
only the plain-matmul path implements it, so the caller runs such blocks on the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from modelpar_kernels.attention import attention_block_backward, attention_block_forward, window_keep


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs, lse and dK/dV sums are kept (and travel) in fp32, or wider for wider inputs."""
    return torch.promote_types(dtype, torch.float32)


def _additive(keep: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


@dataclass(frozen=True)
class BlockMask:
    """How one block is masked: ``keep`` (boolean, broadcast to [b, h, sq, sk]) for the torch paths, or the
    rows' and columns' document ids for the Triton kernel; ``causal``: the block on the diagonal (sq == sk);
    ``window`` W > 0: a query sees keys less than W positions back, ``offset`` being the block's first query
    position minus its first key position (both backends; on the torch paths it is and-ed into ``keep``)."""

    causal: bool
    keep: torch.Tensor | None = None
    q_docs: torch.Tensor | None = None
    k_docs: torch.Tensor | None = None
    window: int = 0
    offset: int = 0
    softcap: float = 0.0

    def torch_keep(self, sq: int, sk: int, device) -> torch.Tensor | None:
        """The boolean mask of the torch paths: ``keep`` and the window (None: plain causal or all visible)."""
        if not self.window:
            return self.keep
        keep = window_keep(sq, sk, self.causal, self.window, self.offset, device)[None, None]
        return keep if self.keep is None else self.keep & keep


def block_attention_forward(q, k, v, mask: BlockMask, backend: str = "torch"):
    """Attention of q [b, hq, sq, d] on k, v [b, hkv, sk, d] -> (out [b, hq, sq, d], lse [b, hq, sq], natural
    log, fp32 or wider). Rows with no visible key get lse = -inf and a zero output."""
    if backend == "triton":
        out, lse = attention_block_forward(
            *(t.transpose(1, 2) for t in (q, k, v)), mask.causal, mask.q_docs, mask.k_docs, mask.window, mask.offset
        )
        return out.transpose(1, 2), lse.to(accumulation_dtype(q.dtype))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    keep = mask.torch_keep(q.shape[2], k.shape[2], q.device)
    causal = mask.causal and keep is None
    scale = q.shape[-1] ** -0.5
    if _cpu_flash(q, v) and not mask.softcap:  # the aten flash op returns the lse on CPU
        additive = None if keep is None else _additive(keep, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=additive, scale=scale
        )
    else:
        out, lse = _block_forward_math(q, k, v, keep, causal, mask.softcap)
    lse = lse.to(accumulation_dtype(q.dtype))
    if keep is not None:
        lse = torch.where(keep.any(-1), lse, float("-inf"))
    return out, lse


def block_attention_backward(dout, q, k, v, out, lse, mask: BlockMask, backend: str = "torch"):
    """Gradients (dq [b, hq, sq, d], dk [b, hkv, sk, d], dv [b, hkv, sk, dv]) of one block, given the rows'
    *merged* output and lse (FlashAttention-2's backward, one block of it)."""
    if backend == "triton":
        dq, dk, dv = attention_block_backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse.float(), mask.causal, mask.q_docs, mask.k_docs,
            mask.window, mask.offset,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = _block_backward_torch(
        dout, q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), out, lse, mask
    )
    return dq, *(rearrange(t, "b (h g) n d -> b h g n d", g=group).sum(2) for t in (dk, dv))


def _block_backward_torch(dout, q, k, v, out, lse, mask: BlockMask):
    keep = mask.torch_keep(q.shape[2], k.shape[2], q.device)
    causal = mask.causal and keep is None
    scale = q.shape[-1] ** -0.5
    if _cpu_flash(q, v) and not mask.softcap:
        additive = None if keep is None else _additive(keep, q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=additive, scale=scale
        )
    return _block_backward_math(dout, q, k, v, out, lse, keep, causal, mask.softcap)


def _cpu_flash(q, v) -> bool:
    """aten's CPU flash op, which returns the lse, takes one head dim for q, k and v; v's may differ (latent
    attention), which the plain matmuls take."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _capped(scores, softcap):
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def _block_forward_math(q, k, v, keep, causal, softcap=0.0):
    """``block_attention_forward`` in plain matmuls (equal heads), for devices without an lse-returning attention op
    and for capped scores."""
    acc = accumulation_dtype(q.dtype)
    scores = _capped(torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * q.shape[-1] ** -0.5, softcap)
    scores = _mask_scores(scores, keep, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.matmul(probs, v.to(acc)).to(q.dtype), lse


def _block_backward_math(dout, q, k, v, out, lse, keep, causal, softcap=0.0):
    """``block_attention_backward`` in plain matmuls (equal heads): FlashAttention-2's backward of one block (a
    capped score's gradient times the cap's derivative ``1 - tanh^2``)."""
    acc = accumulation_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5
    q32, k32, v32, dout32 = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    capped = _capped(torch.matmul(q32, k32.transpose(-1, -2)) * scale, softcap)
    probs = torch.exp(_mask_scores(capped, keep, causal) - lse[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), dout32)
    dp = torch.matmul(dout32, v32.transpose(-1, -2))
    ds = probs * (dp - (dout32 * out.to(acc)).sum(-1, keepdim=True))
    if softcap:
        ds = ds * (1 - (capped / softcap).square())
    dq = torch.matmul(ds, k32) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q32) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _mask_scores(scores, keep, causal):
    if causal:
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril()
    return scores if keep is None else scores.masked_fill(~keep, float("-inf"))
