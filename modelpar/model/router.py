"""A mixture-of-experts router: which experts each token goes to, and with what weight (``modelpar.model.moe``).

    logits [T, E] -> scores: softmax (Mixtral) or sigmoid (DeepSeek-V3)
      -> choice = scores (+ the sigmoid router's balancing bias, which chooses but never weighs)
      -> group-limited (n_group > 1, DeepSeek-V3): experts in n_group contiguous groups of E/n_group; a group
         scores the sum of its two best choice values; all but the topk_group best groups are masked out
      -> chosen [T, k]: the top-k of what is left
      -> weights [T, k]: the chosen scores, renormalised to sum to 1 (norm_topk_prob), times routed_scaling_factor

Routing is per token, so it is the same whatever the layout: it runs before any dispatch over ep.

The sequence-wise balance statistics (DeepSeek-V3 eq. 17-20) are per sequence of the micro-batch: routed
counts and normalised-score sums [b, E] and tokens [b], summed over the ranks that split a sequence (tp: its
tokens; cp: its chunks) so each rank sees whole sequences' values.
"""

from __future__ import annotations

import torch

from modelpar.model.config import MoEConfig


def route(
    logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32) -> (scores [T, E], chosen experts [T, k], weights [T, k]). ``bias`` [E]: the sigmoid
    router's balancing bias (None: softmax)."""
    if bias is None:
        scores = logits.softmax(-1)
        choice = scores
    else:
        scores = logits.sigmoid()
        choice = scores + bias
    if moe.n_group > 1:
        choice = limit_to_groups(choice.detach(), moe.n_group, moe.topk_group)
    chosen = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return scores, chosen, weights


def limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice [T, E] with every expert outside each token's ``topk_group`` best groups set to -inf; a group's
    score is the sum of its two largest values (its only value for groups of one)."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    group_score = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(-1)  # [T, G]
    kept = torch.zeros_like(group_score, dtype=torch.bool)
    kept.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, experts)


def sequence_of_tokens(batch: int, seq: int, tp_rank: int = 0, tp_size: int = 1, split: bool = False) -> torch.Tensor:
    """[T] the micro-batch sequence of each token a MoE layer routes: x [b, s, h] flattened to (b s), then, if
    ``split`` (tp without sequence parallel), this tp rank's contiguous 1/t of them."""
    ids = torch.arange(batch).repeat_interleave(seq)
    return ids.chunk(tp_size)[tp_rank] if split else ids


def sequence_statistics(
    sequence: torch.Tensor, chosen: torch.Tensor, probs: torch.Tensor, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence of this rank's tokens: (routed counts [b, E] and token counts [b] as one [b, E + 1] fp32
    table, normalised-score sums [b, E] with their autograd graph). ``sequence`` [T], ``chosen`` [T, k],
    ``probs`` [T, E]."""
    n_experts, k = probs.shape[1], chosen.shape[1]
    sequence = sequence.to(chosen.device)
    table = torch.zeros(batch, n_experts + 1, dtype=torch.float32, device=chosen.device)
    rows = sequence.repeat_interleave(k)
    table.index_put_((rows, chosen.reshape(-1)), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
    table[:, -1].index_add_(0, sequence, torch.ones_like(sequence, dtype=torch.float32))
    prob_sums = probs.new_zeros(batch, n_experts).index_add(0, sequence, probs)
    return table, prob_sums


__all__ = ["limit_to_groups", "route", "sequence_of_tokens", "sequence_statistics"]
