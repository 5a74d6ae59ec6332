"""One optimizer interface for the trainer, whichever way data parallelism is configured (``optim.zero``).

``DataParallelOptimizer`` is what a training step talks to; ``ReplicatedAdamW`` (``zero=0``: every dp replica
holds the whole AdamW state, gradients averaged by a bucketed all-reduce overlapped with the last backward)
and ``ZeroOneOptimizer`` (``zero=1``: AdamW state sharded over dp, gradients reduce-scattered) implement it;
``modelpar.optim.build.build_optimizer`` picks one (or ``FullyShardedAdamW``, ZeRO-2/3, in
``modelpar.optim.fsdp``). Per step::

    opt.expect_micro_batches(m)                   # before the pipeline runs the backwards
    ... pipeline step ...
    opt.reduce_gradients()                        # gradients: mean over the global batch
    norm = opt.clip_grad_norm(max_norm)           # 0-d tensor on device, each value counted once
    set_lr(opt, lr_at(step, ...)); opt.step()     # unless the step is skipped
    opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from modelpar.optim.adamw import build_adamw
from modelpar.optim.clip import clip_grad_norm
from modelpar.optim.grad_sync import GradientSynchronizer
from modelpar.optim.param_info import ParamsWithInfo
from modelpar.optim.state import (
    MOMENTS,
    MUON_MOMENTS,
    load_optimizer_state_tensors,
    moment_kinds,
    optimizer_state_tensors,
)
from modelpar.optim.zero import ZeroOneAdamW
from modelpar.parallel.groups import ParallelGroups

# optim.zero: 0 replicated, 1 optimizer state sharded over dp (x cp), 2 and gradients, 3 and weights (FSDP2)
ZERO_STAGES = (0, 1, 2, 3)


def _nothing() -> None:
    return None


class DataParallelOptimizer(ABC):
    """AdamW over the dp replicas of this rank's parameters; see the module docstring for a step."""

    optimizer: torch.optim.Optimizer | ZeroOneAdamW

    def __init__(self, params_with_info: ParamsWithInfo, groups: ParallelGroups):
        self.params_with_info = list(params_with_info)
        self.groups = groups
        self._flags_pending = False  # reduce_gradients(defer_flags=True) left has-gradient flags on the device

    @property
    def param_groups(self) -> list[dict]:
        """The decay and no-decay groups: ``set_lr`` writes ``lr`` here."""
        return self.optimizer.param_groups

    def final_backward(self) -> contextlib.AbstractContextManager:
        """Wrap the last micro-batch's backward when not running a pipeline (its gradients may start reducing)."""
        return contextlib.nullcontext()

    def expect_micro_batches(self, micro_batches: int) -> None:
        """Instead of ``final_backward()``, when a pipeline runtime runs the backwards: call at the step's start."""
        return None  # only an overlapped all-reduce needs to know

    def local_gradients(self, see: Callable[[int, torch.Tensor], None]) -> tuple[list[int], Callable[[], None]]:
        """Show ``see(segment, gradient)`` this rank's own gradient of every step before the data-parallel
        reduction mixes it, in segments of flat gradient. Returns the segments' sizes (the same on every dp
        replica) and ``flush``, to call after the step's backward and before ``reduce_gradients``: it shows what
        has not been shown yet. Here each parameter with a gradient is a segment, all shown by ``flush``."""
        params = [p for p, _ in self.params_with_info]

        def flush() -> None:
            for i, p in enumerate(params):
                if p.grad is not None:
                    see(i, p.grad)

        return [p.numel() for p in params], flush

    @abstractmethod
    def reduce_gradients(self, other_reductions: Callable[[], None] = _nothing, defer_flags: bool = False) -> None:
        """Finish the data-parallel average of this step's gradients. ``other_reductions`` (the sums over tp
        and the embedding group) commute with the dp average; each implementation runs them where its own
        reduction allows: after an overlapped all-reduce has written its averages back, before a reduce-scatter
        reads the gradients. ``defer_flags``: which parameters some dp rank gave a gradient (those without keep
        ``grad = None``) is not read back here; the caller reads ``device_flags()`` with its own values and
        passes them to ``apply_flags`` before ``step()`` (until then such parameters hold zero gradients)."""

    @abstractmethod
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` on device; the global norm before clipping (0-d, inf/nan when non-finite)."""

    def device_flags(self) -> torch.Tensor | None:
        """Values on the device the step must read back before ``step()`` (see ``apply_flags``), or None."""
        return self._has_grad_flags() if self._flags_pending else None

    def apply_flags(self, values: list[float]) -> None:
        """Take the values of ``device_flags()``, read back with the step's loss and norm in one host sync."""
        if self._flags_pending:
            self._drop_unused(values)
            self._flags_pending = False

    def step(self) -> None:
        if self._flags_pending:  # the caller did not fold the flags into its own read-back
            self.apply_flags(self._has_grad_flags().tolist())
        self.optimizer.step()

    @abstractmethod
    def _has_grad_flags(self) -> torch.Tensor:
        """Per parameter (or segment), nonzero where some dp rank gave a gradient; after ``reduce_gradients``."""

    @abstractmethod
    def _drop_unused(self, values: list[float]) -> None:
        """``grad = None`` where ``values`` (read from ``_has_grad_flags``) say no dp rank gave one."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop every gradient, so the next step's first backward starts fresh."""

    @abstractmethod
    def full_moments(self) -> tuple[dict[int, dict[str, torch.Tensor]], float] | None:
        """Every local parameter's whole Adam moments keyed by ``id(param)``, and AdamW's step count; None
        before the first step or when parameters disagree on it. Collective over dp under ZeRO."""

    def muon_param_ids(self) -> frozenset[int]:
        """The ids of the parameters Muon updates (``optim.name=muon``); empty under AdamW alone."""
        torch_opt = getattr(self.optimizer, "shard_optimizer", self.optimizer)
        layout = getattr(torch_opt, "layout", None)
        return frozenset(id(p) for p, _ in self.params_with_info if layout is not None and layout.is_muon(p))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state for a safetensors checkpoint (see ``modelpar.optim.state``)."""
        return optimizer_state_tensors(self.optimizer)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        load_optimizer_state_tensors(self.optimizer, tensors)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class ReplicatedAdamW(DataParallelOptimizer):
    """``optim.zero=0``: torch's AdamW on every replica; gradients averaged by ``GradientSynchronizer``."""

    def __init__(self, params_with_info: ParamsWithInfo, groups: ParallelGroups, *, bucket_bytes: int, **adam):
        super().__init__(params_with_info, groups)
        dense = [p for p, info in self.params_with_info if not info.expert_parallel]
        experts = [p for p, info in self.params_with_info if info.expert_parallel]
        # weights are replicated over dp x cp: gradients average over both (dp_cp is dp when cp=1)
        uses = {id(p): info.uses for p, info in self.params_with_info if info.uses != 1}
        self.sync = GradientSynchronizer(dense, groups.dp_cp_group, bucket_bytes=bucket_bytes, uses=uses)
        self.syncs = [self.sync]
        if experts:  # summed over the ranks holding the same experts, averaged over every token of dp x cp
            group = groups.expert_dp_group if len(groups.expert_dp_ranks) > 1 else None
            divisor = len(groups.dp_cp_ranks)
            self.syncs.append(
                GradientSynchronizer(experts, group, bucket_bytes=bucket_bytes, divisor=divisor, uses=uses)
            )
        self.optimizer = build_adamw(self.params_with_info, **adam)

    def final_backward(self) -> contextlib.AbstractContextManager:
        if len(self.syncs) == 1:
            return self.sync.final_backward()
        stack = contextlib.ExitStack()
        for sync in self.syncs:
            stack.enter_context(sync.final_backward())
        return stack

    def expect_micro_batches(self, micro_batches: int) -> None:
        for sync in self.syncs:
            sync.expect_micro_batches(micro_batches)

    def local_gradients(self, see: Callable[[int, torch.Tensor], None]) -> tuple[list[int], Callable[[], None]]:
        """Each all-reduce bucket is a segment, shown just before its all-reduce averages it in place (during
        the last backward, or by ``flush``); parameters with no other replica to sync with are one each."""
        sizes: list[int] = []
        for sync in self.syncs:
            if sync.buckets:
                sync.before_launch = functools.partial(lambda first, b, g: see(first + b, g), len(sizes))
                sizes += [bucket.numel for bucket in sync.buckets]
        loose = [p for sync in self.syncs if not sync.buckets for p in sync.params]
        first = len(sizes)

        def flush() -> None:
            for sync in self.syncs:
                sync.launch_pending()
            for i, p in enumerate(loose):
                if p.grad is not None:
                    see(first + i, p.grad)

        return sizes + [p.numel() for p in loose], flush

    def reduce_gradients(self, other_reductions: Callable[[], None] = _nothing, defer_flags: bool = False) -> None:
        read_back = not defer_flags or all(not sync.buckets for sync in self.syncs)  # one replica: no flags to read
        for sync in self.syncs:  # the buckets copied the gradients when they launched: tp etc. after
            sync.wait(read_back=read_back)
        self._flags_pending = not read_back
        other_reductions()

    def _has_grad_flags(self) -> torch.Tensor:
        return torch.cat([sync.flags() for sync in self.syncs if sync.buckets])

    def _drop_unused(self, values: list[float]) -> None:
        start = 0
        for sync in self.syncs:
            if sync.buckets:
                n = sum(len(bucket.params) for bucket in sync.buckets)
                sync.drop_unused(values[start : start + n])
                start += n

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.params_with_info, max_norm, self.groups)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_moments(self) -> tuple[dict[int, dict[str, torch.Tensor]], float] | None:
        state_of = {id(p): st for p, st in self.optimizer.state.items()}
        steps = {float(st["step"]) for st in state_of.values() if "step" in st}  # Muon's state has none
        if len(steps) != 1:
            return None
        kinds = (*MOMENTS, *MUON_MOMENTS)
        return {k: {kind: st[kind] for kind in kinds if kind in st} for k, st in state_of.items()}, steps.pop()


class ZeroOneOptimizer(DataParallelOptimizer):
    """``optim.zero=1``: AdamW state and fp32 masters sharded over dp x cp (``ZeroOneAdamW``); a mixture of
    experts' expert weights over the ranks holding the same experts."""

    def __init__(self, params_with_info: ParamsWithInfo, groups: ParallelGroups, **adam):
        super().__init__(params_with_info, groups)
        experts = {}
        if any(info.expert_parallel for _, info in self.params_with_info):  # sharded over the ranks holding them
            group = groups.expert_dp_group if len(groups.expert_dp_ranks) > 1 else None
            experts = dict(expert_group=group, expert_divisor=len(groups.dp_cp_ranks))
        self.optimizer = ZeroOneAdamW(self.params_with_info, groups.dp_cp_group, **adam, **experts)  # over dp x cp

    def reduce_gradients(self, other_reductions: Callable[[], None] = _nothing, defer_flags: bool = False) -> None:
        other_reductions()
        self.optimizer.reduce_gradients(read_back=not defer_flags)
        self._flags_pending = defer_flags

    def _has_grad_flags(self) -> torch.Tensor:
        return self.optimizer.has_grad

    def _drop_unused(self, values: list[float]) -> None:
        self.optimizer.apply_has_grad(values)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.optimizer.shard_params_with_info(), max_norm, self.groups, zero_sharded=True)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def full_moments(self) -> tuple[dict[int, dict[str, torch.Tensor]], float] | None:
        gathered = self.optimizer.full_moments((*MOMENTS, *MUON_MOMENTS))
        if gathered is None:
            return None
        per_param, step = gathered
        muon = self.muon_param_ids()
        return {
            id(p): {kind: state[kind] for kind in moment_kinds(id(p) in muon)}
            for p, state in zip(self.optimizer.params, per_param, strict=True)
        }, step
