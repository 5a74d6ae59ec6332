"""Runs on emulated ranks that record what layout comparisons check: each step's loss and gradient norm, the first
step's reduced gradients, the final parameters, and the metrics a full ``fit()`` logs. The expert-parallel and
multi-token-prediction layout tests share them."""

from __future__ import annotations

import json
from pathlib import Path


def train_and_collect(cfg, data_path: str):
    """On every rank: train ``cfg.trainer.steps`` steps; return (loss, grad norm) per step, this rank's pieces of
    every logical tensor's gradient at the first step (as the optimizer applies it: reduced over every group,
    clipped; not under ZeRO, whose reduced gradients live in its shards) and of every parameter at the end, and
    the turns DualPipeV's pairs handed over."""
    from modelpar.checkpoint.reshard import model_pieces
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    first_grads, zero_grad = {}, trainer.optimizer.zero_grad

    def record_then_zero():
        for chunk in trainer.model.chunks:
            for name, shard in chunk.logical_shards().items():
                if shard.grad is not None and trainer.step == 0 and not cfg.optim.zero:
                    region = tuple(
                        (s.start or 0, s.stop or n) for s, n in zip(shard.index, shard.global_shape, strict=True)
                    )
                    first_grads[(name, region)] = shard.grad.detach().clone()
        zero_grad()

    trainer.optimizer.zero_grad = record_then_zero
    losses = []
    while trainer.step < cfg.trainer.steps:
        metrics = trainer.train_step()
        losses.append((metrics.loss, metrics.grad_norm))
    pieces = {(p.name, p.region): t.detach().clone() for p, t in model_pieces(trainer.model.chunks).items()}
    return losses, first_grads, pieces, trainer.runtime.pair_handovers


def fit_and_read_metrics(cfg, data_path: str) -> list[dict]:
    """On every rank: ``fit()``; rank 0 returns the lines of its metrics.jsonl (the others an empty list)."""
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    trainer.fit()
    path = Path(cfg.trainer.out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if trainer.rank == 0 else []
