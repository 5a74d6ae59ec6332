"""Cross-entropy over vocab-parallel logits: each tp rank holds a slice of the vocabulary.

The full-vocab logits are never gathered: per token, the local max, sum of exponentials and target logit are
combined over the tp group with three small all-reduces of ``n`` elements each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from modelpar import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, ignore_index):
        n, local = logits.shape
        x = logits.float()
        col = torch.arange(vocab_start, vocab_start + local, device=logits.device)
        padded = col >= vocab_size  # rows added to make the vocab divisible by tp never take part
        if padded.any():
            x = x.masked_fill(padded, float("-inf"))
        row_max = x.max(dim=-1).values
        if group is not None:
            comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        shifted = x - row_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < local) & (targets != ignore_index)
        index = torch.where(mine, local_target, torch.zeros_like(local_target))
        target_logit = torch.where(mine, shifted.gather(1, index[:, None]).squeeze(1), torch.zeros_like(sum_exp))
        if group is not None:
            both = torch.stack((sum_exp, target_logit))
            comm.all_reduce(both, group)
            sum_exp, target_logit = both[0], both[1]
        valid = targets != ignore_index
        n_valid = valid.sum().clamp(min=1)
        loss = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(sum_exp)).sum() / n_valid
        ctx.save_for_backward(exp, sum_exp, index, mine, valid, n_valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, index, mine, valid, n_valid = ctx.saved_tensors
        grad = exp / sum_exp[:, None]
        grad.scatter_add_(1, index[:, None], -mine.to(grad.dtype)[:, None])
        grad *= (valid.to(grad.dtype) * grad_loss / n_valid)[:, None]
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over tokens whose target is not ``ignore_index``.

    logits: [n, V_local], this rank's columns ``vocab_start .. vocab_start + V_local`` of the (padded) vocab;
    targets: [n] global token ids; ``vocab_size``: the true vocab (columns at or past it are padding).
    """
    vocab_size = vocab_start + logits.shape[-1] if vocab_size is None else vocab_size
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, vocab_size, group, ignore_index)
