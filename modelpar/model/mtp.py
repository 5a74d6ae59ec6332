"""Multi-token prediction (DeepSeek-V3 section 2.2): ``model.mtp_depth`` = D sequential modules on the last stage.

Module k (1..D) predicts token i+k+1 at position i from the previous depth's hidden state h^{k-1} (h^0: the main
model's last block output, before the final norm) and the embedding of token i+k:

    h'^k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1})])     eh_proj [h, 2h], replicated over tp
    h^k  = Block_k(h'^k)                                        a full block, of the kind of the model's last
    loss_k = CE(lm_head(norm_k(h^k)), t_{i+k+1})                the shared embedding and output head

    loss = main + mtp_loss_weight / D * sum_k loss_k

(the concatenation puts the embedding first, as DeepSeek-V3's released ``eh_proj`` weights do). Everything a
module needs at position i is a later token of the same window, so the training step stacks the targets
shifted by 0..D (``stack_targets``: [b, s, 1 + D], -100 past the window) before the context-parallel split, and
every cp rank holds exactly the shifted tokens of its own positions. loss_k is a mean over the positions whose
tokens t_{i+1}..t_{i+k+1} all exist: each cp rank divides its sum by the cp group's count / cp, so the mean of
the cp ranks' losses is the single device's. Tensor parallel: the embedding is vocab-parallel, the block is
tp-sharded like any other, the head and loss are the vocab-parallel ones; under sequence parallel every
module works on the [b, s/t, h] stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modelpar.model.config import ModelConfig
from modelpar.model.layers import RMSNorm, ShardInfo
from modelpar.parallel.collectives import all_reduce, comm_tag

IGNORE = -100


def stack_targets(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """targets [b, s] (targets[i] = t_{i+1}) -> [b, s, 1 + depth]: column j is t_{i+1+j}, -100 past the window."""
    columns = [targets]
    for j in range(1, depth + 1):
        columns.append(F.pad(targets[:, j:], (0, j), value=IGNORE))
    return torch.stack(columns, -1)


class MTPModule(nn.Module):
    """Depth k's norms, projection and block (logical names ``mtp.<k-1>.enorm.weight``, ``hnorm``, ``eh_proj``,
    the block's ``self_attn`` / ``mlp`` / norms, and ``norm`` before the shared head)."""

    def __init__(self, config: ModelConfig, block: nn.Module, tp, *, sequence_parallel: bool, backend: str, **kw):
        super().__init__()
        h, eps = config.hidden, config.norm_eps
        norm_kw = dict(sequence_parallel=sequence_parallel, backend=backend, **kw)
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.enorm = RMSNorm(h, eps, tp, **norm_kw)
        self.hnorm = RMSNorm(h, eps, tp, **norm_kw)
        self.eh_proj = nn.Parameter(torch.zeros(h, 2 * h, **kw))
        self.block = block
        self.norm = RMSNorm(h, eps, tp, **norm_kw)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """h^{k-1}, Emb(t_{i+k}): [b, s, h] (or [b, s/t, h]) -> h^k, the same shape."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], -1)
        return self.block(F.linear(joined, self.eh_proj.to(joined.dtype)))

    def logical_shards(self, prefix: str) -> dict[str, ShardInfo]:
        tp = self.tp.size > 1
        shards = self.enorm.logical_shards(prefix + "enorm.") | self.hnorm.logical_shards(prefix + "hnorm.")
        shards[prefix + "eh_proj.weight"] = ShardInfo(
            self.eh_proj,
            slice(None),
            tuple(self.eh_proj.shape),
            replicated_over_tp=tp,
            primary=self.tp.rank == 0,
            grad_is_partial=tp and self.sequence_parallel,  # each tp rank projected its own tokens
        )
        return shards | self.block.logical_shards(prefix) | self.norm.logical_shards(prefix + "norm.")


class MultiTokenPrediction(nn.Module):
    """The D modules and their loss; ``embed``, ``head`` and ``cross_entropy`` are the chunk's shared ones.

    ``losses`` [D] (detached, summed over calls) and ``tokens`` [D] (this rank's predicted positions) accumulate
    until ``take()``, for the step's metrics."""

    def __init__(self, config: ModelConfig, modules: list[MTPModule], cp, weight: float):
        super().__init__()
        self.modules_ = nn.ModuleList(modules)
        self.cp, self.weight, self.depth = cp, weight, len(modules)
        self.losses: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        self.calls = 0

    def loss(self, hidden, targets, embed, head, cross_entropy) -> torch.Tensor:
        """``mtp_loss_weight / D * sum_k loss_k`` for the main hidden state [b, s(/t), h] and the stacked targets
        [b, s, 1 + D]; ``head(norm_k(h))`` gives this rank's vocab-shard logits."""
        total, values, counts = hidden.new_zeros((), dtype=torch.float32), [], []
        valid = targets[..., 0] != IGNORE
        for k, module in enumerate(self.modules_, start=1):
            valid = valid & (targets[..., k] != IGNORE)  # t_{i+1} .. t_{i+k+1} all in the window
            target = targets[..., k].masked_fill(~valid, IGNORE)
            hidden = module(hidden, embed(targets[..., k - 1].clamp_min(0)))
            local = valid.sum().to(torch.float32)
            whole = local.clone()
            if self.cp.size > 1:  # positions of these sequences on every cp rank
                with comm_tag("loss"):
                    all_reduce(whole, self.cp.group)
            mean = cross_entropy(head(module.norm(hidden)), target)
            loss_k = mean * local * self.cp.size / whole.clamp_min(1.0)
            total = total + loss_k
            values.append(loss_k.detach())
            counts.append(local)
        if torch._C._current_graph_task_id() == -1:  # not a recomputed forward inside a backward
            self._record(torch.stack(values), torch.stack(counts))
        return total * (self.weight / self.depth)

    def _record(self, values: torch.Tensor, counts: torch.Tensor) -> None:
        self.losses = values if self.losses is None else self.losses + values
        self.tokens = counts if self.tokens is None else self.tokens + counts
        self.calls += 1

    def take(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(summed per-depth losses [D], predicted positions [D], calls) since the last take, or None."""
        if self.losses is None:
            return None
        out = (self.losses, self.tokens, self.calls)
        self.losses = self.tokens = None
        self.calls = 0
        return out


__all__ = ["MTPModule", "MultiTokenPrediction", "stack_targets"]
