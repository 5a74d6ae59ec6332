"""The planner's prediction for a training recipe: the strategy a ``TrainConfig`` runs, split as the trainer
splits it, and the bytes ``modelpar-bench`` measures beside it. Here, above training, because it reads the
trainer's own pipeline split."""

from __future__ import annotations

import dataclasses

from modelpar.plan.memory import stage_memory
from modelpar.plan.presets import HARDWARE
from modelpar.plan.spec import Hardware, MemoryBreakdown, ModelSpec, Strategy
from modelpar.training.build import build_partition


def recipe_strategy(cfg) -> Strategy:
    """The strategy a training recipe (``TrainConfig``) runs: its layout, micro-batching, recompute, offload,
    ZeRO stage and group, and the trainer's own pipeline split (``build_partition``)."""
    p = cfg.parallel
    layout = p.layout()
    return Strategy(
        layout,
        cfg.data.global_batch // (layout.dp * p.microbatches),
        p.microbatches,
        p.recompute,
        cfg.optim.zero,
        p.sp and p.tp > 1,
        p.cp_comm,
        recompute_modules=tuple(p.recompute_modules),
        offload=p.offload_activations,
        zero_group=cfg.optim.zero_group,
        stage_layers=build_partition(cfg).layer_counts,
        pipeline=p.schedule if p.pp > 1 else "",
        reduce_every_micro_batch=cfg.optim.reduce_every_micro_batch,
        optimizer=cfg.optim.name,
        sp_keep_shard=p.sp_keep_shard,
    )


def recipe_memory(cfg, hardware: Hardware | None = None) -> list[MemoryBreakdown]:
    """Predicted bytes on the fullest rank of every pipeline stage of a training recipe, on ``hardware`` (by
    default the ``cpu`` preset in the recipe's dtype): what ``modelpar-bench`` measures beside it."""
    hardware = hardware or dataclasses.replace(HARDWARE["cpu"], dtype="bf16" if cfg.trainer.dtype == "bf16" else "fp32")
    strategy = recipe_strategy(cfg)
    model = ModelSpec(cfg.model)
    return [stage_memory(model, strategy, cfg.data.seq_len, hardware, r) for r in range(strategy.layout.pp)]
