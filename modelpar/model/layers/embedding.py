"""Vocabulary-parallel token embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modelpar.model.layers.shard import ShardInfo, load_full_weights
from modelpar.parallel.regions import TensorParallelGroup, reduce_from_tp_region, reduce_scatter_to_sequence_region


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp_size`` so every rank holds the same number of rows."""
    return -(-vocab_size // tp_size) * tp_size


def vocab_range(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """``(start, size)``: the token ids ``start .. start + size`` of the padded vocabulary this rank holds."""
    size = padded_vocab_size(vocab_size, tp.size) // tp.size
    return tp.rank * size, size


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary (rows of ``E``) split over the tp ranks::

          E [V_pad, h]          V_pad = V rounded up to a multiple of t; padded rows stay zero
        +-------------+
    r0  | ids 0..V/t  |         each rank looks up the ids it owns, zeros for the others: partial [b, s, h]
        +-------------+         g: reduce_from_tp_region (all-reduce fwd, identity bwd) -> [b, s, h]
    r1  | ids V/t..V  |         or reduce_scatter_to_sequence_region (reduce-scatter fwd, all-gather bwd)
        +-------------+            -> [b, s/t, h] with sequence parallel
        | padding     |
        +-------------+
    """

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        tp: TensorParallelGroup,
        *,
        name: str = "weight",
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.vocab_size, self.hidden, self.name = vocab_size, hidden, name
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        self.vocab_start, local = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.zeros(local, hidden, device=device, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [b, s] int64 -> [b, s, h] (or [b, s/t, h] with sequence parallel)."""
        local = ids - self.vocab_start
        foreign = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        out = out.masked_fill(foreign[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.tp)
        return reduce_from_tp_region(out, self.tp)

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        held = max(0, min(self.weight.shape[0], self.vocab_size - self.vocab_start))
        return {
            prefix + self.name: ShardInfo(
                param=self.weight,
                local_rows=slice(0, held),
                global_shape=(self.vocab_size, self.hidden),
                dim=0 if self.tp.size > 1 else None,
                offset=self.vocab_start,
            )
        }

    def load_full(self, weight: torch.Tensor) -> VocabParallelEmbedding:
        """Set this rank's rows from the full single-device table [V, h] (padded rows stay zero). Returns the layer."""
        load_full_weights(self.logical_shards(), weight)
        return self
