"""One optimizer step of one rank, shaped for a GPU: the loss, the norm and the skip flags stay on the device
until a single read-back at the end of the step.

    batch (this dp replica's share of the global batch) -> m micro-batches -> pipeline runtime (F/B[/W])
      -> dp average (bucketed all-reduce overlapped with the last backward) or ZeRO-1 reduce-scatter
      -> reduce tp-partial grads (sequence-parallel norms, replicated kv heads)
      -> sum tied-embedding grads over the embedding group (first + last stage)
      -> global grad norm (each parameter counted once), clipped on device
      -> one world all-reduce of the loss: its dp mean, and a non-finite value anywhere seen everywhere
      -> the one host sync: [loss, norm] read back; the guard decides skip / halt identically on every rank
      -> LR schedule, AdamW
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from modelpar.data import TokenFile, WindowSampler
from modelpar.optim import DataParallelOptimizer, lr_at, set_lr
from modelpar.optim.fsdp import is_sharded, local
from modelpar.parallel import collectives
from modelpar.parallel.context import document_ids, split_for_context
from modelpar.parallel.groups import ParallelGroups
from modelpar.pipeline import PipelineRuntime, StepResult
from modelpar.training.build import RankModel, resolve_eos_id
from modelpar.training.config import TrainConfig
from modelpar.training.health import HealthError, LossGuard
from modelpar.training.moe_stats import MoEStatistics
from modelpar.training.outliers import GradientOutlierCheck
from modelpar.training.sdc import SilentCorruptionCheck


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_time_s: float
    mfu: float | None
    skipped: str | None = None  # why the update was not applied (non-finite, spike), else None
    skipped_total: int = 0
    stragglers: list[int] | None = None  # ranks named slow at this step's check
    drift: list[str] | None = None  # parameters found differing at this step's check
    moe: dict | None = None  # mixture of experts: aux loss, dropped fraction, per-layer expert load


class StepHook(Protocol):
    """Called by ``TrainStep`` at fixed points (fault injection registers one; plain training has none)."""

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor: ...

    def after_update(self, step: int) -> None: ...


@dataclass
class TrainStep:
    """Everything one step needs; ``step(i)`` runs optimizer step ``i`` (counted from 0)."""

    cfg: TrainConfig
    groups: ParallelGroups
    model: RankModel
    runtime: PipelineRuntime
    optimizer: DataParallelOptimizer
    tokens: TokenFile
    sampler: WindowSampler
    device: torch.device
    dtype: torch.dtype
    guard: LossGuard
    flops_per_step: float
    hooks: tuple[StepHook, ...] = ()
    outliers: GradientOutlierCheck | None = None  # with trainer.grad_outlier_action != off and dp >= 2
    sdc: SilentCorruptionCheck | None = None  # with trainer.sdc_check_every > 0

    def __post_init__(self) -> None:
        self.eos_id = resolve_eos_id(self.cfg, str(self.tokens.path))  # None without data.document_mask
        self.moe_stats = MoEStatistics(self.model.chunks, self.groups) if self.cfg.model.moe.enabled else None

    def __call__(self, step: int) -> tuple[StepMetrics, StepResult]:
        cfg = self.cfg
        start = time.perf_counter()
        inputs, targets = self.tokens.batch(self.sampler.next_batch())
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        m = cfg.parallel.microbatches
        for p, _ in self.model.params:
            p.grad = None
        self.optimizer.expect_micro_batches(m)  # buckets all-reduce during the last backward
        checking_sdc = self.sdc is not None and (step + 1) % cfg.trainer.sdc_check_every == 0
        micro_inputs, micro_targets, documents = self._micro_batches(inputs, targets, m)
        self._tell_documents(documents, lambda: self.runtime.current.micro_batch)
        if checking_sdc:
            self.sdc.arm()
        if self.moe_stats is not None:
            self.moe_stats.begin_step()
        try:
            with self._autocast():
                result = self.runtime.step(micro_inputs, micro_targets)
            moe_table = self.moe_stats.table(self.device) if self.moe_stats is not None else None
        except BaseException:
            if checking_sdc:
                self.sdc.disarm()
            raise
        # the local gradients, before the dp average is written back: is this replica's like the others'?
        replica_stats = self.outliers.stats() if self.outliers is not None else None
        self.optimizer.reduce_gradients(self._reduce_over_tp_and_embedding, defer_flags=True)
        norm = self.optimizer.clip_grad_norm(cfg.optim.grad_clip)
        corruption = None
        if checking_sdc:  # the first micro-batch again, compared bit for bit (one extra micro-batch)
            self._tell_documents(documents, lambda: 0)
            replaying = self.moe_stats.replaying() if self.moe_stats is not None else contextlib.nullcontext()
            with self._autocast(), replaying:
                corruption = self.sdc.rerun(micro_inputs[0], micro_targets[0], step)
            if self.moe_stats is not None:
                self.moe_stats.discard()  # the rerun's routing is not the step's
        loss = result.loss_tensor
        for hook in self.hooks:
            loss = hook.loss(step, loss)
        loss = self._global_mean(loss.to(torch.float64))
        flags = self.optimizer.device_flags()
        read = [loss.reshape(1), norm.to(loss).reshape(1)]
        read += [flags.to(loss).reshape(-1)] if flags is not None else []
        read += [replica_stats.to(loss).reshape(-1)] if replica_stats is not None else []
        n_moe = 0 if moe_table is None else moe_table.numel()
        read += [moe_table.to(loss).reshape(-1)] if moe_table is not None else []
        values = torch.cat(read).tolist()  # the step's one host sync
        loss_value, norm_value = values[:2]
        n_flags = 0 if flags is None else flags.numel()
        self.optimizer.apply_flags(values[2 : 2 + n_flags])
        skipped = self.guard.check(step, loss_value, norm_value)  # same inputs on every rank: the same decision
        if replica_stats is not None and skipped is None:
            skipped = self._judge_replicas(values[2 + n_flags : len(values) - n_moe], step)
        if corruption is not None and skipped is None:
            skipped = self._judge_corruption(corruption)
        lr = lr_at(step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.trainer.steps, cfg.optim.min_lr)
        if skipped is None:
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            if moe_table is not None:
                self.moe_stats.apply_bias(moe_table)  # the same global loads on every rank: the same bias
        self.optimizer.zero_grad()
        for hook in self.hooks:
            hook.after_update(step)
        elapsed = time.perf_counter() - start
        tokens = cfg.data.global_batch * cfg.data.seq_len
        peak = cfg.trainer.peak_tflops * 1e12 * self.groups.layout.world_size
        metrics = StepMetrics(
            step=step + 1,
            loss=loss_value,
            lr=lr,
            grad_norm=norm_value,
            tokens_per_s=tokens / elapsed,
            step_time_s=elapsed,
            mfu=(self.flops_per_step / elapsed / peak) if peak > 0 else None,
            skipped=skipped,
            skipped_total=self.guard.skipped,
            moe=self.moe_stats.metrics(values[len(values) - n_moe :]) if moe_table is not None else None,
        )
        return metrics, result

    def _judge_replicas(self, stats: list[float], step: int) -> str | None:
        """The outlier check's verdict, the same on every rank: None, or why the update is skipped."""
        message = self.outliers.verdict(stats, step)
        return None if message is None else self._act_on(message, "grad_outlier_action")

    def _judge_corruption(self, message: str) -> str | None:
        """The silent-corruption check's verdict (gathered: the same on every rank) acted on."""
        return self._act_on(message, "sdc_action")

    def _act_on(self, message: str, setting: str) -> str | None:
        """A check's finding under ``trainer.<setting>``: halt, skip the update (the reason returned), or warn."""
        action = getattr(self.cfg.trainer, setting)
        if action == "halt":
            raise HealthError(f"{message}; halting (trainer.{setting}=halt)")
        if action == "skip":
            self.guard.skipped += 1
            return message
        if self.groups.rank == 0:
            print(f"modelpar-train: {message}", flush=True)
        return None

    def _micro_batches(self, inputs: torch.Tensor, targets: torch.Tensor, m: int):
        """This rank's micro-batches of tokens and targets (under cp: its two chunks of every sequence) and,
        with ``data.document_mask``, the document ids [b, s] of each micro-batch's whole sequences (else None)."""
        documents = None
        if self.cfg.data.document_mask:
            documents = document_ids(inputs, self.eos_id).chunk(m)
        cp = self.model.chunks[0].cp
        inputs, targets = split_for_context(inputs, cp), split_for_context(targets, cp)
        return list(inputs.chunk(m)), list(targets.chunk(m)), documents

    def _tell_documents(self, documents, micro_batch) -> None:
        """Point the attention layers at the document ids of the micro-batch ``micro_batch()`` computes now."""
        if documents is None:
            return
        for chunk in self.model.chunks:
            chunk.documents.source = lambda: documents[micro_batch()]

    def _global_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss over dp x cp, from one all-reduce over the world (tp and pp ranks of a replica hold the
        same loss; only one of them contributes it, the others a zero multiple, so a NaN anywhere still
        reaches every rank and all skip together). Each cp rank's loss is the mean over its equal share of
        every sequence's tokens, so their mean is the global batch's."""
        g = self.groups
        if g.layout.world_size == 1:
            return loss
        primary = g.tp_rank == 0 and g.pp_rank == 0
        contribution = (loss if primary else loss * 0.0).reshape(1).to(torch.float64)
        collectives.all_reduce(contribution, None)
        return (contribution / (g.layout.dp * g.layout.cp)).reshape(())

    def _reduce_over_tp_and_embedding(self) -> None:
        """Sums that commute with the dp average: tp-partial gradients, then the tied embedding's two copies."""
        for chunk in self.model.chunks:
            chunk.reduce_tensor_parallel_grads()
        self._sync_tied_embedding()

    def _sync_tied_embedding(self) -> None:
        """The embedding on the first stage and its copy on the last stage get the sum of both gradients."""
        tied = self.model.tied
        if not tied:
            return
        if is_sharded(tied[0]):  # ZeRO-2/3: both stages hold the same dp shard of it; sum the local shards
            grads = [local(p.grad) for p in tied if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads]) if len(grads) == len(tied) else None
            if flat is None:
                raise RuntimeError("a tied embedding copy has no gradient under ZeRO-2/3")
            with collectives.comm_tag("tied_embedding"):
                collectives.all_reduce(flat, self.groups.embedding_group)
            for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(piece.view_as(g))
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tied]
        flat = torch.cat([g.flatten() for g in grads])
        with collectives.comm_tag("tied_embedding"):
            collectives.all_reduce(flat, self.groups.embedding_group)
        for p, piece in zip(tied, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = piece.view_as(p).clone()

    def _autocast(self):
        """bf16 compute over fp32 master weights: parameters, gradients and optimizer state stay fp32."""
        if self.dtype == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
