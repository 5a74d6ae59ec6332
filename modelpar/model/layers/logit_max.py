"""The largest attention logit of each query head, for QK-clip (``modelpar.training.qk_clip``).

``max_attention_logits(q, k, cp, ...)``: ``max over (batch, query, visible key) of q . k / sqrt(d)`` per local
query head, over exactly the logits the softmax sees (causal, the sliding window, the document mask). Under
context parallelism the keys of every cp rank are gathered (detached, one all-gather of k per layer and
micro-batch) and masked by their global positions; each rank's maximum covers its own queries, and the step
takes the maximum over cp (and dp, and the micro-batches). It recomputes the scores outside the attention
kernel, which never materialises them: one more ``q k^T`` per layer, the price of tracking.
"""

from __future__ import annotations

import torch

from modelpar.parallel import collectives
from modelpar.parallel.context import ContextParallelGroup, local_positions


@torch.no_grad()
def max_attention_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    cp: ContextParallelGroup,
    *,
    window: int = 0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [b, s, hq, d], k: [b, s, hkv, d] (this rank's tokens, after RoPE); documents: [b, s * cp] ids or
    None. Returns [hq] fp32: each query head's largest visible logit."""
    s, hq, d = q.shape[1], q.shape[2], q.shape[3]
    seq = s * cp.size
    if cp.size > 1:
        keys = collectives.all_gather(k.detach().contiguous(), cp.group, dim=1)  # [b, cp*s, hkv, d], rank order
        k_pos = torch.cat([local_positions(seq, cp.size, r, q.device) for r in range(cp.size)])
        q_pos = local_positions(seq, cp.size, cp.rank, q.device)
    else:
        keys, k_pos = k, torch.arange(s, device=q.device)
        q_pos = k_pos
    keys = keys.float().repeat_interleave(hq // keys.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) * d**-0.5
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    visible = visible[None, None]
    if documents is not None:
        same = documents[:, q_pos][:, :, None] == documents[:, k_pos][:, None, :]  # [b, q, k]
        visible = visible & same[:, None]
    return scores.masked_fill(~visible, float("-inf")).amax(dim=(0, 2, 3))


__all__ = ["max_attention_logits"]
