"""What one rank's model chunk is and how it runs, as one frozen object every block takes whole.

    ChunkSpec(layer_ids=(4, 5, 6), first=False, last=True, split_blocks={4: "mlp"}, sequence_parallel=True)

The model's shape (``ModelConfig``: sizes, heads, MoE, kernels) says *what function* is computed; a
``ChunkSpec`` says *which piece of it* this chunk holds (layer ids, embedding, head, split blocks) and *how*
it computes it on this rank (sequence parallel, recompute, the cp exchange, device, parameter dtype). An
option of how a chunk runs is a field here: ``ModelChunk`` and ``Block`` read it from the spec, nothing
threads it by hand. ``ChunkGroups`` carries the process groups the chunk talks over (tp, cp, ep).

Techniques applied to built chunks from above (compile, activation offload, FSDP2 sharding, the MoE step
settings) are ``modelpar.model.parallelize``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from modelpar.model.activations import DEFAULT_SELECTIVE, RecomputePolicy
from modelpar.model.layers.fp8 import FP8_MODES
from modelpar.parallel.context import CP_COMMS, ContextParallelGroup
from modelpar.parallel.experts import ExpertParallelGroup
from modelpar.parallel.regions import TensorParallelGroup

BLOCK_HALVES = ("attention", "mlp")


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of the model on one rank.

    ``layer_ids``: the blocks it holds, ascending; ``first``: it holds the embedding; ``last``: the final norm,
    the head and the loss. ``split_blocks``: blocks held only in part (``{4: "mlp"}``: block 4's MLP half, its
    attention being in the previous chunk); only the first block may be an ``"mlp"`` half and only the last an
    ``"attention"`` half, so the chunk stays a contiguous piece of the model. ``sequence_parallel``: the
    residual stream sharded along the sequence over tp (a no-op at tp=1); ``sp_keep_shard``: its column-parallel
    linears keep their input's sequence shard for backward, not the gathered input, where the half is not rerun
    (``ColumnParallelLinear.keep_shard``). ``recompute`` (none | selective |
    full) with ``recompute_modules`` (for selective). ``cp_comm`` (ring | allgather | alltoall | hybrid): how
    attention exchanges K/V (or heads) under context parallelism; ``cp_a2a``: hybrid's all-to-all group size.
    ``fp8`` (off | rowwise | tensorwise): the attention and dense MLP projections' GEMMs in FP8
    (``modelpar.model.layers.fp8``; embedding, head, norms and MoE layers stay in the compute dtype).
    ``device`` and ``dtype``: where the parameters live and their dtype (None: torch's defaults; the compute
    dtype of activations is the runtime's).
    """

    layer_ids: tuple[int, ...]
    first: bool = True
    last: bool = True
    split_blocks: Mapping[int, str] = field(default_factory=dict)
    sequence_parallel: bool = False
    sp_keep_shard: bool = True
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = DEFAULT_SELECTIVE
    cp_comm: str = "ring"
    cp_a2a: int = 0
    fp8: str = "off"
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        ids = tuple(self.layer_ids)
        object.__setattr__(self, "layer_ids", ids)
        object.__setattr__(self, "split_blocks", dict(self.split_blocks or {}))
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"layer_ids={ids} must be ascending and distinct")
        for i, half in self.split_blocks.items():
            if half not in BLOCK_HALVES:
                raise ValueError(f"split_blocks={self.split_blocks}: a half is one of {BLOCK_HALVES}, not {half!r}")
            if not ((ids and i == ids[0] and half == "mlp") or (ids and i == ids[-1] and half == "attention")):
                raise ValueError(
                    f"split_blocks={self.split_blocks}: only the first block may be an 'mlp' half and only the last "
                    f"an 'attention' half of layer_ids={ids}"
                )
        if self.fp8 not in FP8_MODES:
            raise ValueError(f"fp8={self.fp8!r} must be one of {FP8_MODES}")
        if self.cp_comm not in CP_COMMS:
            raise ValueError(f"cp_comm={self.cp_comm!r} must be one of {CP_COMMS}")
        self.recompute_policy()  # raises on an unknown mode or module

    @classmethod
    def whole(cls, layers: int, **options) -> ChunkSpec:
        """The whole model of ``layers`` blocks as one chunk (no pipeline); ``options``: the other fields."""
        return cls(tuple(range(layers)), first=True, last=True, **options)

    def half(self, layer: int) -> str | None:
        """The half of block ``layer`` this chunk holds (``"attention"``, ``"mlp"``), or None for all of it."""
        return self.split_blocks.get(layer)

    def recompute_policy(self) -> RecomputePolicy:
        """How each block runs its halves (``modelpar.model.activations``)."""
        return RecomputePolicy(self.recompute, self.recompute_modules)


@dataclass(frozen=True)
class ChunkGroups:
    """The groups a chunk communicates over: tp inside every layer, cp in attention, ep in the MoE layers."""

    tp: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    cp: ContextParallelGroup = field(default_factory=ContextParallelGroup)
    ep: ExpertParallelGroup = field(default_factory=ExpertParallelGroup)

    @classmethod
    def of(cls, groups=None, cp_comm: str = "ring", cp_a2a: int = 0) -> ChunkGroups:
        """From a ``ParallelGroups`` (its tp, cp and ep groups; K/V exchanged by ``cp_comm``, hybrid's
        all-to-all over ``cp_a2a`` cp ranks), a
        ``TensorParallelGroup`` (tp only), or None (the single device)."""
        if isinstance(groups, ChunkGroups):
            return groups
        if groups is None:
            return cls(cp=ContextParallelGroup(comm=cp_comm))
        if isinstance(groups, TensorParallelGroup):
            return cls(tp=groups, cp=ContextParallelGroup(comm=cp_comm))
        return cls(
            TensorParallelGroup.of(groups),
            ContextParallelGroup.of(groups, cp_comm, cp_a2a),
            ExpertParallelGroup.of(groups),
        )


__all__ = ["BLOCK_HALVES", "ChunkGroups", "ChunkSpec"]
