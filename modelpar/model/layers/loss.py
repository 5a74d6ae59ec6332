"""Cross-entropy on vocab-parallel logits (the full-vocab logits are never gathered)."""

from __future__ import annotations

import torch
from einops import rearrange
from modelpar_kernels import vocab_parallel_cross_entropy
from torch import nn

from modelpar.model.layers.embedding import vocab_range
from modelpar.parallel.collectives import all_reduce
from modelpar.parallel.regions import TensorParallelGroup

IGNORE_INDEX = -100


def vocab_parallel_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp: TensorParallelGroup,
    vocab_size: int,
    *,
    backend: str = "torch",
) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose target is not -100.

    logits: [b, s, V_pad/t], this rank's slice of the padded vocabulary (columns >= ``vocab_size`` are padding
    and never take part); targets: [b, s] global token ids. Communication (torch reference): an all-reduce of
    the row max (b*s elements) and one of sum-exp and target logit together (2*b*s); the kernels run them
    through the engine's ``all_reduce``, so ``record_comm`` counts them.
    """
    start, _ = vocab_range(vocab_size, tp)
    return vocab_parallel_cross_entropy(
        rearrange(logits, "b s v -> (b s) v"),
        rearrange(targets, "b s -> (b s)"),
        vocab_start=start,
        vocab_size=vocab_size,
        group=tp.group if tp.size > 1 else None,
        ignore_index=IGNORE_INDEX,
        all_reduce=all_reduce,
        backend=backend,
    )


class VocabParallelCrossEntropy(nn.Module):
    """``vocab_parallel_loss`` as a module (no parameters), so hooks can label its collectives from outside."""

    def __init__(self, vocab_size: int, tp: TensorParallelGroup, backend: str = "torch"):
        super().__init__()
        self.vocab_size, self.tp, self.backend = vocab_size, tp, backend

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logits: [b, s, V_pad/t], targets: [b, s] -> the mean loss (0-d)."""
        return vocab_parallel_loss(logits, targets, self.tp, self.vocab_size, backend=self.backend)
