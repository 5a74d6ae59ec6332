"""A step's routing statistics of every MoE layer, summed over the global batch, and the balancing-bias update.

Each MoE layer accumulates on the device what its forwards routed (``MoELayer.take_stats``). Once per step one
all-reduce over the world sums a table with a row per MoE layer of the model: every layer lives on one pipeline
stage, where every tp x dp x cp rank routed its own tokens, so the world sum is the global batch's count. The
table joins the step's one host read; the sigmoid router's bias moves from it on the device, identically on
every rank.
"""

from __future__ import annotations

import contextlib

import torch

from modelpar.model.transformer import ModelChunk
from modelpar.parallel import collectives
from modelpar.parallel.groups import ParallelGroups

# columns after the per-expert counts
DROPPED, ROUTED, AUX = range(3)


class MoEStatistics:
    """``table()`` before the step's read-back, ``apply_bias(table)`` after an applied update, ``metrics(row
    values)`` for the step's metrics. The layer ids are the model's MoE layers (``config.moe``)."""

    def __init__(self, chunks: list[ModelChunk], groups: ParallelGroups):
        self.groups = groups
        config = chunks[0].config
        self.layer_ids = [i for i in range(config.layers) if config.moe.is_moe_layer(i)]
        if config.moe.is_moe_layer(config.layers - 1):  # multi-token prediction's blocks, as layers L, L+1, ...
            self.layer_ids += [config.layers + k for k in range(config.mtp_depth)]
        self.experts = config.moe.experts
        self.local = {i: moe for chunk in chunks for i, moe in chunk.moe_layers().items()}
        # the aux loss is already global: one rank of each stage reports it
        self.reports_aux = groups.tp_rank == 0 and groups.rank == min(groups.dp_cp_ranks)

    def table(self, device: torch.device) -> torch.Tensor | None:
        """[MoE layers, E + 3] float64: tokens per expert, dropped, routed, aux loss (global sums). Collective
        over the world."""
        if not self.layer_ids:
            return None
        table = torch.zeros(len(self.layer_ids), self.experts + 3, dtype=torch.float64, device=device)
        for row, layer in enumerate(self.layer_ids):
            moe = self.local.get(layer)
            stats = moe.take_stats() if moe is not None else None
            if stats is None:
                continue
            table[row, : self.experts] = stats["tokens_per_expert"]
            table[row, self.experts + DROPPED] = stats["dropped"]
            table[row, self.experts + ROUTED] = stats["routed"]
            if self.reports_aux:
                table[row, self.experts + AUX] = stats["aux_loss"]
        if self.groups.layout.world_size > 1:
            with collectives.comm_tag("moe_stats"):
                collectives.all_reduce(table, None)
        return table

    def begin_step(self) -> None:
        """Before a step's first forward: the whole-batch aux loss starts counting afresh."""
        for moe in self.local.values():
            moe.begin_step()

    @contextlib.contextmanager
    def replaying(self):
        """Around a rerun of one of the last step's micro-batches: its routing is not counted again and its
        aux-loss gradient is the step's."""
        for moe in self.local.values():
            moe.replaying = True
        try:
            yield
        finally:
            for moe in self.local.values():
                moe.replaying = False

    def discard(self) -> None:
        """Forget what the local layers routed since the last ``table()`` (a rerun that is not a step)."""
        for moe in self.local.values():
            moe.take_stats()

    def apply_bias(self, table: torch.Tensor) -> None:
        """Move each local sigmoid router's balancing bias from the global loads (device only)."""
        for row, layer in enumerate(self.layer_ids):
            if layer in self.local:
                self.local[layer].update_bias(table[row, : self.experts])

    def metrics(self, values: list[float]) -> dict:
        """The table read back (flattened) -> per-layer load, imbalance (max / mean tokens per expert), aux loss
        and dropped fraction, plus their totals."""
        width = self.experts + 3
        layers, aux_total, dropped, routed = {}, 0.0, 0.0, 0.0
        for row, layer in enumerate(self.layer_ids):
            cells = values[row * width : (row + 1) * width]
            load = cells[: self.experts]
            mean = sum(load) / self.experts
            layers[str(layer)] = {
                "tokens_per_expert": [int(c) for c in load],
                "imbalance": max(load) / mean if mean else 0.0,
                "aux_loss": cells[self.experts + AUX],
                "dropped_fraction": cells[self.experts + DROPPED] / max(cells[self.experts + ROUTED], 1.0),
            }
            aux_total += cells[self.experts + AUX]
            dropped += cells[self.experts + DROPPED]
            routed += cells[self.experts + ROUTED]
        return {"aux_loss": aux_total, "dropped_fraction": dropped / max(routed, 1.0), "layers": layers}
