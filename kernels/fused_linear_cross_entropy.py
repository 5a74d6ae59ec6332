"""Head projection fused with vocab-parallel cross-entropy, chunked over tokens (as Liger-Kernel's).

The logits of the whole sequence are never materialised: tokens go through in chunks of ``chunk_size``; for
each chunk the logits ``[chunk, V_local]`` are computed, turned into their gradient in place by the
cross-entropy kernels, and immediately contracted into the hidden gradient and an fp32 weight-gradient
accumulator. Backward only scales the two stored gradients by the incoming one.

Vocab-parallel like ``F.linear`` followed by ``vocab_parallel_cross_entropy``: ``weight`` is this rank's rows
of the (padded) vocab and the returned hidden gradient is this rank's partial sum; the all-reduce that
completes it belongs to the caller's copy-to-tp op in front of the head, exactly as in the unfused model.

    hidden: [n, h]   weight: [V_local, h]   targets: [n]   -> mean loss over tokens != ignore_index
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from modelpar_kernels.cross_entropy import cross_entropy_forward_in_place, vocab_parallel_cross_entropy_reference
from modelpar_kernels.launch import check_device, triton


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy_reference(hidden @ weight.T, targets, ...)``."""
    return vocab_parallel_cross_entropy_reference(
        F.linear(hidden, weight),
        targets,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        group=group,
        ignore_index=ignore_index,
    )


def default_chunk_size(n: int, hidden_size: int, n_local: int) -> int:
    """Tokens per chunk so one chunk's logits are about as large as the hidden states (a power of two)."""
    return min(triton.next_power_of_2(n), triton.next_power_of_2(triton.cdiv(n, triton.cdiv(n_local, hidden_size))))


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked head + cross-entropy; gradients are computed in forward (see the module docstring).

    Backward scales the stored hidden gradient in place, so it runs once per forward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, vocab_size, group, ignore_index, chunk_size):
        check_device(hidden, weight, targets)
        n, h = hidden.shape
        n_local = weight.shape[0]
        if weight.shape[1] != h or targets.shape != (n,):
            raise ValueError(
                f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
                f"targets {tuple(targets.shape)} do not fit [n, h], [V_local, h], [n]"
            )
        chunk_size = chunk_size or default_chunk_size(n, h, n_local)
        n_valid = (targets != ignore_index).sum().clamp(min=1)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            chunk = slice(start, min(n, start + chunk_size))
            logits = hidden[chunk] @ weight.t()  # [chunk, V_local]; becomes d loss / d logits below
            loss += cross_entropy_forward_in_place(
                logits, targets[chunk], vocab_start, vocab_size, group, ignore_index, n_valid
            )
            torch.mm(logits, weight, out=grad_hidden[chunk])
            if ctx.needs_input_grad[1]:
                grad_weight.add_(logits.t() @ hidden[chunk])  # product in the input dtype, summed in fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_linear_cross_entropy_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Same loss as ``fused_linear_cross_entropy_reference`` without the [n, V_local] logits (chunks of tokens).

    ``chunk_size``: tokens per chunk (default: logits of one chunk about the size of ``hidden``).
    """
    vocab_size = vocab_start + weight.shape[0] if vocab_size is None else vocab_size
    return FusedLinearCrossEntropyFunction.apply(
        hidden, weight, targets, vocab_start, vocab_size, group, ignore_index, chunk_size
    )
