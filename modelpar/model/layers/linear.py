"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019), without bias as in Llama or with one
(Qwen2's q, k, v; GPT-OSS's o_proj)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from modelpar.model.layers.fp8 import Fp8Scaling, fp8_linear
from modelpar.model.layers.sequence_linear import sequence_parallel_column_linear
from modelpar.model.layers.shard import ColumnPart, ShardInfo, load_full_weights
from modelpar.parallel.context import ContextParallelGroup
from modelpar.parallel.regions import (
    TensorParallelGroup,
    column_parallel_matmul,
    copy_to_tp_region,
    gather_from_sequence_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)


def bias_name(weight_name: str) -> str:
    """The logical name of the bias beside weight ``weight_name``: ``q_proj.weight`` -> ``q_proj.bias``."""
    return weight_name.removesuffix("weight") + "bias"


class ColumnParallelLinear(nn.Module):
    """``y = x @ W.T`` with the output features (rows of ``W``) split over the tp ranks::

                 W [out, in]
            +----------------+      x [b, s, in] replicated, or [b, s/t, in] under sequence parallel
        r0  |      W_0       |      f: identity fwd, all-reduce bwd (overlapped with the weight gradient), or
            +----------------+         under sequence parallel gather_from_sequence_region (all-gather fwd,
                                       reduce-scatter bwd)
        r1  |      W_1       |      each rank: y_r = x @ W_r.T  [b, s, out/t], no communication
            +----------------+

    ``out_features`` an int: one logical tensor ``name`` split evenly, rank r holding rows r*out/t .. (r+1)*out/t.
    Or a sequence of ``ColumnPart``: several logical tensors fused into one local weight (q/k/v, gate/up), each
    split on its own, or one split unevenly (the vocabulary padded to a multiple of t)::

          q_proj [q, in]   k_proj [k, in]   v_proj [k, in]          local weight of rank r [(q + 2k)/t, in]
          +----------+     +----------+     +----------+            +----------+
      r0  |   q_0    |     |   k_0    |     |   v_0    |            |   q_r    |
          +----------+     +----------+     +----------+     ->     +----------+
      r1  |   q_1    |     |   k_1    |     |   v_1    |            |   k_r    |
          +----------+     +----------+     +----------+            +----------+
                                                                    |   v_r    |     y_r: [b, s, (q + 2k)/t]
                                                                    +----------+

    ``fp8`` (rowwise | tensorwise): the matmul and both of its backward GEMMs in FP8 (``modelpar.model.layers.fp8``),
    the input gathered (or entered through f) first, scales reduced over tp (the output features) and ``cp``
    (the tokens).

    ``bias``: ``y = x @ W.T + b`` with ``b`` split like the rows of ``W`` (each part's bias, named as its weight
    with ``.bias``, is the rows of it this rank holds), so no rank adds another's.

    ``keep_shard`` (sequence parallel only; ``parallel.sp_keep_shard``): backward's weight gradient reads the
    gathered input; True keeps the ``[b, s/t, in]`` shard and all-gathers it again in backward, overlapped with
    the input gradient's matmul (``modelpar.model.layers.sequence_linear``), False keeps the gathered
    ``[b, s, in]`` (t times the bytes, one all-gather fewer).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[ColumnPart],
        tp: TensorParallelGroup,
        *,
        name: str = "weight",
        sequence_parallel: bool = False,
        fp8: str = "off",
        cp: ContextParallelGroup | None = None,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.fp8 = None if fp8 == "off" else Fp8Scaling(fp8, tokens=cp, outputs=tp)
        if isinstance(out_features, int):
            if out_features % tp.size:
                raise ValueError(f"{name}: {out_features} output features do not split over tp={tp.size}")
            self.parts = (ColumnPart.even(name, out_features, tp.rank, tp.size),)
        else:
            self.parts = tuple(out_features)
        self.in_features = in_features
        self.out_features = sum(p.rows for p in self.parts)  # of the single-device layer, every part whole
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        # under sequence parallel: keep only the input's 1/t shard for backward and gather it again there
        # (``modelpar.model.layers.sequence_linear``); a block whose half is rerun in backward turns it off
        self.keep_shard = True
        rows = sum(p.size for p in self.parts)
        # zeros: rows past a part's end (vocab padding) are never loaded and must stay inert
        self.weight = nn.Parameter(torch.zeros(rows, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(rows, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, in] (or [b, s/t, in] with sequence parallel) -> [b, s, local out]."""
        if self.sequence_parallel and self.keep_shard and self.tp.size > 1:
            y = sequence_parallel_column_linear(x, self.weight, self.tp, self.fp8)
        elif self.fp8 is not None:
            x = gather_from_sequence_region(x, self.tp) if self.sequence_parallel else copy_to_tp_region(x, self.tp)
            y = fp8_linear(x, self.weight, self.fp8)
        elif self.sequence_parallel:
            y = F.linear(gather_from_sequence_region(x, self.tp), self.weight)
        else:
            y = column_parallel_matmul(x, self.weight, self.tp)
        return y if self.bias is None else y + self.bias

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        shards, start = {}, 0
        for part in self.parts:
            held = max(0, min(part.size, part.rows - part.offset))
            pieces = [(part.name, self.weight, (part.rows, self.in_features))]
            if self.bias is not None:
                pieces.append((bias_name(part.name), self.bias, (part.rows,)))
            for name, param, shape in pieces:
                shards[prefix + name] = ShardInfo(
                    param=param,
                    local_rows=slice(start, start + held),
                    global_shape=shape,
                    dim=None if part.size == part.rows else 0,
                    offset=part.offset,
                    replicated_over_tp=part.replicas > 1,
                    primary=part.primary,
                    grad_is_partial=part.replicas > 1,
                )
            start += part.size
        return shards

    def load_full(self, weight: torch.Tensor | Mapping[str, torch.Tensor]) -> ColumnParallelLinear:
        """Set this rank's rows from the full single-device weight [out, in] (fused: ``{part name: weight}``),
        sliced as ``ModelChunk.load_logical`` slices it. Returns the layer."""
        load_full_weights(self.logical_shards(), weight)
        return self


class RowParallelLinear(nn.Module):
    """``y = x @ W.T`` with the input features (columns of ``W``) split over the tp ranks::

           W [out, in]
    +--------+--------+
    |  W_0   |  W_1   |        x_r [b, s, in/t] (the output of a column-parallel layer, never gathered)
    +--------+--------+        each rank: partial y_r = x_r @ W_r.T   [b, s, out]
       r0       r1             g: reduce_from_tp_region  (all-reduce fwd, identity bwd) -> y [b, s, out]
                               or reduce_scatter_to_sequence_region (reduce-scatter fwd, all-gather bwd)
                                  -> y [b, s/t, out] with sequence parallel

    ``fp8`` (rowwise | tensorwise): the partial matmul and its backward GEMMs in FP8, scales reduced over tp (the
    input features) and ``cp`` (the tokens).

    ``bias`` b [out]: added once, after the partial sums are reduced (added before, the sum would hold it t
    times). Every rank holds all of it; its gradient is complete on each without sequence parallel and this
    rank's tokens' share with it (``ShardInfo.grad_is_partial``, summed over tp), as for a norm weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallelGroup,
        *,
        name: str = "weight",
        sequence_parallel: bool = False,
        fp8: str = "off",
        cp: ContextParallelGroup | None = None,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.fp8 = None if fp8 == "off" else Fp8Scaling(fp8, tokens=cp, inputs=tp)
        if in_features % tp.size:
            raise ValueError(f"{name}: {in_features} input features do not split over tp={tp.size}")
        self.in_features, self.out_features, self.name = in_features, out_features, name
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.zeros(out_features, in_features // tp.size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, in/t] -> [b, s, out] (or [b, s/t, out] with sequence parallel), summed over tp."""
        y = F.linear(x, self.weight) if self.fp8 is None else fp8_linear(x, self.weight, self.fp8)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.tp)
        else:
            y = reduce_from_tp_region(y, self.tp)
        return y if self.bias is None else y + self.bias

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        local = self.in_features // self.tp.size
        shards = {
            prefix + self.name: ShardInfo(
                param=self.weight,
                local_rows=slice(None),
                global_shape=(self.out_features, self.in_features),
                dim=1 if self.tp.size > 1 else None,
                offset=self.tp.rank * local,
            )
        }
        if self.bias is not None:
            shards[prefix + bias_name(self.name)] = ShardInfo(
                param=self.bias,
                local_rows=slice(None),
                global_shape=(self.out_features,),
                replicated_over_tp=self.tp.size > 1,
                primary=self.tp.rank == 0,
                grad_is_partial=self.sequence_parallel and self.tp.size > 1,
            )
        return shards

    def load_full(self, weight: torch.Tensor) -> RowParallelLinear:
        """Set this rank's columns from the full single-device weight [out, in]. Returns the layer."""
        load_full_weights(self.logical_shards(), weight)
        return self
