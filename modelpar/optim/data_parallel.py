"""One optimizer API for the trainer, whichever way data parallelism is configured (``optim.zero``)."""

from __future__ import annotations

import contextlib

import torch

from modelpar.optim.adamw import build_adamw
from modelpar.optim.clip import clip_grad_norm
from modelpar.optim.grad_sync import DEFAULT_BUCKET_BYTES, GradientSynchronizer
from modelpar.optim.param_info import ParamsWithInfo
from modelpar.optim.state import load_optimizer_state_tensors, optimizer_state_tensors
from modelpar.optim.zero import ZeroOneAdamW
from modelpar.parallel.groups import ParallelGroups


class DataParallelOptimizer:
    """AdamW over the dp replicas: bucketed all-reduce overlapped with backward (``zero=False``) or ZeRO-1.

    Per step::

        for i, micro_batch in enumerate(micro_batches):
            with opt.final_backward() if i == m - 1 else contextlib.nullcontext():
                (loss(micro_batch) / m).backward()
        opt.reduce_gradients()                        # gradients: mean over the global batch
        norm = opt.clip_grad_norm(max_norm)           # counted once across tp/pp/dp
        if math.isfinite(norm):
            set_lr(opt, lr_at(step, ...)); opt.step()
        opt.zero_grad()
    """

    def __init__(
        self,
        params_with_info: ParamsWithInfo,
        groups: ParallelGroups,
        *,
        zero: bool,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        self.params_with_info = list(params_with_info)
        self.groups = groups
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.sync: GradientSynchronizer | None = None
        self.optimizer: torch.optim.Optimizer | ZeroOneAdamW
        if zero:
            self.optimizer = ZeroOneAdamW(self.params_with_info, groups.dp_group, **hyper)
        else:
            params = [p for p, _ in self.params_with_info]
            self.sync = GradientSynchronizer(params, groups.dp_group, bucket_bytes=bucket_bytes)
            self.optimizer = build_adamw(self.params_with_info, **hyper)

    @property
    def param_groups(self) -> list[dict]:
        """The decay and no-decay groups: ``set_lr`` writes ``lr`` here."""
        return self.optimizer.param_groups

    def final_backward(self) -> contextlib.AbstractContextManager:
        """Wrap the last micro-batch's backward: its gradients start reducing while backward runs.

        ZeRO-1 reduce-scatters once, after backward, so the block is then a plain one.
        """
        return self.sync.final_backward() if self.sync else contextlib.nullcontext()

    def expect_micro_batches(self, micro_batches: int) -> None:
        """Instead of ``final_backward()``, when a pipeline runtime runs the backwards: call at the step's start."""
        if self.sync:
            self.sync.expect_micro_batches(micro_batches)

    def reduce_gradients(self) -> None:
        """Finish the data-parallel average of this step's gradients."""
        if self.sync:
            self.sync.wait()
        else:
            self.optimizer.reduce_gradients()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to ``max_norm`` and return the global norm before clipping (inf/nan when non-finite)."""
        if self.sync:
            return clip_grad_norm(self.params_with_info, max_norm, self.groups)
        return clip_grad_norm(self.optimizer.shard_params_with_info(), max_norm, self.groups, zero_sharded=True)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Drop every gradient (``None``), so the next step's first backward starts fresh."""
        if self.sync:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.zero_grad()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state for a safetensors checkpoint (see ``modelpar.optim.state``)."""
        return optimizer_state_tensors(self.optimizer)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        load_optimizer_state_tensors(self.optimizer, tensors)
