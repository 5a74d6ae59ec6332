"""Cross-entropy over vocab-parallel logits: each tp rank holds a slice of the vocabulary.

The full-vocab logits are never gathered: per token, the local max, sum of exponentials and target logit are
combined over the tp group with small all-reduces of ``n`` elements each.

The Triton path makes two passes over this rank's logits, one program per token: the first streams the row in
blocks with an online softmax (local max, local sum of exponentials, target logit); after the all-reduces, the
second writes the gradient ``(softmax - onehot) / n_valid`` over the logits *in place*, during forward, so
backward only scales it by the incoming gradient. No second logits-sized tensor is ever allocated, and the
caller's logits buffer is consumed: it holds the gradient after the call.

The tp group comes in as an argument, and so may the all-reduce run over it (``all_reduce``, called as
``all_reduce(tensor, group, op=...)``, in place): an engine passes its own to count or reroute the collectives;
the default is ``torch.distributed.all_reduce``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from modelpar_kernels.grid import check_device, row_block, tl, triton

AllReduce = Callable[..., torch.Tensor]


def torch_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place ``torch.distributed.all_reduce`` of ``tensor`` over ``group``; returns it."""
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, ignore_index, all_reduce):
        n, local = logits.shape
        x = logits.float()
        col = torch.arange(vocab_start, vocab_start + local, device=logits.device)
        if vocab_start + local > vocab_size:  # rows added to make the vocab divisible by tp never take part
            x = x.masked_fill(col >= vocab_size, float("-inf"))
        row_max = x.max(dim=-1).values
        if group is not None:
            all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        shifted = x - row_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < local) & (targets != ignore_index)
        index = torch.where(mine, local_target, torch.zeros_like(local_target))
        target_logit = torch.where(mine, shifted.gather(1, index[:, None]).squeeze(1), torch.zeros_like(sum_exp))
        if group is not None:
            both = torch.stack((sum_exp, target_logit))
            all_reduce(both, group)
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
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    all_reduce: AllReduce = torch_all_reduce,
) -> torch.Tensor:
    """Mean cross-entropy over tokens whose target is not ``ignore_index``.

    logits: [n, V_local], this rank's columns ``vocab_start .. vocab_start + V_local`` of the (padded) vocab;
    targets: [n] global token ids; ``vocab_size``: the true vocab (columns at or past it are padding).
    ``group``: the tp group holding the other columns (None: this rank holds the whole vocab); ``all_reduce``
    runs the two small all-reduces over it (see the module docstring).
    """
    vocab_size = vocab_start + logits.shape[-1] if vocab_size is None else vocab_size
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, vocab_size, group, ignore_index, all_reduce)


@triton.jit
def _cross_entropy_stats_kernel(
    MAX,
    SUM_EXP,
    TARGET_LOGIT,
    LOGITS,
    TARGETS,
    stride_logits,
    n_local,
    n_real,
    vocab_start,
    ignore_index,
    BLOCK_SIZE: tl.constexpr,
):
    """Per token over this rank's real columns: max, sum of exp(x - max), and the target's logit (0 if not here)."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    local_target = target - vocab_start
    # -1 (no column) unless the target is one of this rank's real columns (the block may run past them)
    local_target = tl.where((target != ignore_index) & (local_target >= 0) & (local_target < n_real), local_target, -1)
    row_ptr = LOGITS + row * stride_logits
    m = float("-inf")
    d = 0.0
    target_logit = 0.0
    for start in range(0, n_real, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        x = tl.load(row_ptr + cols, mask=cols < n_real, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        target_logit += tl.sum(tl.where(cols == local_target, x, 0.0), axis=0)
    tl.store(MAX + row, m)
    tl.store(SUM_EXP + row, d)
    tl.store(TARGET_LOGIT + row, target_logit)


@triton.jit
def _cross_entropy_grad_kernel(
    LOGITS,
    TARGETS,
    LSE,
    stride_logits,
    n_local,
    n_real,
    vocab_start,
    ignore_index,
    SCALE,
    BLOCK_SIZE: tl.constexpr,
):
    """Overwrite the row with ``(softmax - onehot(target)) * scale``; ignored rows and padded columns get 0."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    lse = tl.load(LSE + row)
    row_scale = tl.where(target != ignore_index, tl.load(SCALE), 0.0)
    local_target = target - vocab_start
    row_ptr = LOGITS + row * stride_logits
    for start in range(0, n_local, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        x = tl.load(row_ptr + cols, mask=cols < n_real, other=float("-inf")).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(cols == local_target, 1.0, 0.0)
        grad = tl.where(cols < n_real, grad * row_scale, 0.0)
        tl.store(row_ptr + cols, grad.to(LOGITS.dtype.element_ty), mask=cols < n_local)


def cross_entropy_forward_in_place(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    ignore_index: int,
    all_reduce: AllReduce,
) -> torch.Tensor:
    """Mean loss over the valid tokens; leaves d(loss)/d(logits) in ``logits``.

    logits: [n, V_local] with unit column stride (overwritten); targets: [n].
    """
    n, n_local = logits.shape
    n_real = max(0, min(n_local, vocab_size - vocab_start))  # columns past the true vocab are padding
    block, num_warps = row_block(n_local, max_block=4096)
    local_max = torch.empty(n, dtype=torch.float32, device=logits.device)
    sum_exp = torch.empty_like(local_max)
    target_logit = torch.empty_like(local_max)
    targets = targets.contiguous()
    common = (logits.stride(0), n_local, n_real, vocab_start, ignore_index)
    _cross_entropy_stats_kernel[(n,)](
        local_max, sum_exp, target_logit, logits, targets, *common, BLOCK_SIZE=block, num_warps=num_warps
    )
    row_max = local_max.clone()
    if group is not None:
        all_reduce(row_max, group, op=dist.ReduceOp.MAX)
    # Rescale each rank's sum to the global max (a rank whose columns are all padding contributes 0).
    sum_exp = torch.where(sum_exp > 0, sum_exp * torch.exp(local_max - row_max), 0.0)
    if group is not None:
        both = torch.stack((sum_exp, target_logit))
        all_reduce(both, group)
        sum_exp, target_logit = both[0], both[1]
    lse = row_max + sum_exp.log()
    valid = targets != ignore_index
    n_valid = valid.sum().clamp(min=1)
    loss = torch.where(valid, lse - target_logit, 0.0).sum() / n_valid
    scale = (1.0 / n_valid.float()).reshape(1)  # a tensor, so no host sync
    _cross_entropy_grad_kernel[(n,)](logits, targets, lse, *common, scale, BLOCK_SIZE=block, num_warps=num_warps)
    return loss


class CrossEntropyFunction(torch.autograd.Function):
    """Triton vocab-parallel cross-entropy; the input logits are overwritten with their gradient in forward.

    Backward scales that stored gradient in place, so it runs once per forward (no ``retain_graph`` replays).
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, ignore_index, all_reduce):
        check_device(logits, targets)
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()  # then the copy is what is consumed
        loss = cross_entropy_forward_in_place(logits, targets, vocab_start, vocab_size, group, ignore_index, all_reduce)
        ctx.save_for_backward(logits.detach())
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss.to(grad.dtype)), None, None, None, None, None, None


def vocab_parallel_cross_entropy_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    all_reduce: AllReduce = torch_all_reduce,
) -> torch.Tensor:
    """Same loss as ``vocab_parallel_cross_entropy_reference``; **consumes ``logits``** (they hold the gradient)."""
    vocab_size = vocab_start + logits.shape[-1] if vocab_size is None else vocab_size
    return CrossEntropyFunction.apply(logits, targets, vocab_start, vocab_size, group, ignore_index, all_reduce)
