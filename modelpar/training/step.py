"""One optimizer step of one rank, shaped for a GPU: the loss, the norm and the skip flags stay on the device
until a single read-back at the end of the step.

    batch (this dp replica's share of the global batch) -> m micro-batches -> pipeline runtime (F/B[/W])
      -> gradients finalised (``modelpar.optim.finalize``): the dp average (bucketed all-reduce overlapped
         with the last backward, or a reduce-scatter), tp-partial sums, the tied embedding's two copies
      -> global grad norm (each parameter counted once), clipped on device
      -> one world all-reduce of the loss: its dp mean, and a non-finite value anywhere seen everywhere
      -> the one host sync: loss, norm and each plug-in's values read back by name (``training.plugins``);
         the guard and the plug-ins' checks decide skip / halt identically on every rank
      -> LR schedule, AdamW
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from modelpar.data import TokenFile, WindowSampler
from modelpar.model.mtp import stack_targets
from modelpar.optim import DataParallelOptimizer, lr_at, set_lr
from modelpar.optim.finalize import finalize_grads
from modelpar.parallel import collectives
from modelpar.parallel.context import document_ids, split_for_context
from modelpar.parallel.groups import ParallelGroups
from modelpar.pipeline import PipelineRuntime, StepResult
from modelpar.training import security
from modelpar.training.build import RankModel, resolve_eos_id
from modelpar.training.config import TrainConfig
from modelpar.training.health import HealthError, LossGuard
from modelpar.training.plugins import StepPlugin
from modelpar.training.readback import ReadBack


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
    mtp: dict | None = None  # multi-token prediction: each depth's mean loss, the tokens it predicted
    checkpoint: dict | None = None  # an asynchronous save: its step, the save step's stall, the wait at its finish


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
    plugins: tuple[StepPlugin, ...] = ()  # the optional features, in the order they are called
    # called before anything changes the weights or moments (an asynchronous save may still be copying them)
    fence: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.eos_id = resolve_eos_id(self.cfg, str(self.tokens.path))  # None without data.document_mask

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
        micro_inputs, micro_targets, documents = self._micro_batches(inputs, targets, m)
        self._tell_documents(documents, lambda: self.runtime.current.micro_batch)
        for plugin in self.plugins:
            plugin.begin(step)
        try:
            with self._autocast():
                result = self.runtime.step(micro_inputs, micro_targets)
            for plugin in self.plugins:  # the local gradients, before the dp average is written back
                plugin.before_reduce()
        except BaseException:
            for plugin in self.plugins:
                plugin.abort()
            raise
        finalize_grads(
            self.optimizer, self.model.chunks, self.groups, tied=self.model.tied, whole_experts=self.model.whole_experts
        )
        norm = self.optimizer.clip_grad_norm(cfg.optim.grad_clip)

        def replay(run):  # the step's first micro-batch again, as the step ran it (one extra micro-batch)
            self._tell_documents(documents, lambda: 0)
            with self._autocast():
                return run(micro_inputs[0], micro_targets[0])

        for plugin in self.plugins:
            plugin.after_clip(step, replay)
        loss = result.loss_tensor
        for plugin in self.plugins:
            loss = plugin.loss(step, loss)
        loss = self._global_mean(loss.to(torch.float64))
        read = ReadBack()
        read.add("loss", loss)
        read.add("grad_norm", norm)
        handed = [(p, p.hand()) for p in self.plugins]
        for plugin, value in handed:
            if value is not None:
                read.add(plugin.name, value)
        values = read.values()  # the step's one host sync
        loss_value, norm_value = values["loss"][0], values["grad_norm"][0]
        for plugin, value in handed:
            if value is not None:
                plugin.take(values[plugin.name])
        skipped = self.guard.check(step, loss_value, norm_value)  # same inputs on every rank: the same decision
        for plugin in self.plugins:
            if skipped is None and plugin.setting is not None:
                finding = plugin.verdict(step)
                skipped = None if finding is None else self._act_on(finding, plugin.setting)
        lr = lr_at(step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.trainer.steps, cfg.optim.min_lr)
        if self.fence is not None:
            self.fence()
        if skipped is None:
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        self.optimizer.zero_grad()
        for plugin in self.plugins:
            plugin.after_update(step, applied=skipped is None)
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
        )
        for plugin in self.plugins:
            metrics = replace(metrics, **plugin.metrics())
        return metrics, result

    def _act_on(self, message: str, setting: str) -> str | None:
        """A check's finding under ``trainer.<setting>``: halt, skip the update (the reason returned), or warn."""
        action = getattr(self.cfg.trainer, setting)
        if setting == "grad_outlier_action" and self.groups.rank == 0:
            security.record(self.cfg.trainer.out_dir, "poisoned-replica", None, f"{message} ({setting}={action})")
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
        if self.cfg.model.mtp_depth:  # the later tokens of every position, shifted before the cp split
            targets = stack_targets(targets, self.cfg.model.mtp_depth)
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

    def _autocast(self):
        """bf16 compute over fp32 master weights: parameters, gradients and optimizer state stay fp32."""
        if self.dtype == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
