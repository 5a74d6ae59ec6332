"""The optional features of a training step, as named plug-ins the step calls at fixed points.

A plug-in hands the step's one read-back the device tensor it needs on the host (``hand``) and gets its own
values back by its name (``take``); the step knows none of them. The points, in the step's order:

    begin(step)           before the pipeline runs (arm a check, reset what counts a step)
    abort()               the pipeline run failed: undo ``begin``
    before_reduce()       the step's local gradients, before they are finalised (collectives allowed)
    after_clip(step, replay)  gradients final and clipped; ``replay`` reruns the step's first micro-batch
    loss(step, loss)      the local loss before its dp mean (fault injection poisons it here)
    hand() -> tensor      what to read back (None: nothing this step)
    take(values)          those values, read back with the step's loss and norm
    verdict(step) -> str  a finding, acted on under ``trainer.<setting>`` (halt | skip | warn)
    after_update(step, applied)   after the optimizer step (or its skip)
    metrics() -> dict     fields of ``StepMetrics`` this plug-in fills

``Trainer`` builds the list from the recipe (``step_plugins``); plain training has the ZeRO flags only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from modelpar.optim import DataParallelOptimizer
from modelpar.parallel import collectives
from modelpar.training.moe_stats import MoEStatistics
from modelpar.training.outliers import GradientOutlierCheck
from modelpar.training.sdc import SilentCorruptionCheck

# replay(fn): run fn(inputs, targets) over the step's first micro-batch, as the step ran it
Replay = Callable[[Callable[[torch.Tensor, torch.Tensor], object]], object]


class StepPlugin:
    """A named optional feature of the step; every point is a no-op unless overridden (module docstring)."""

    name = "plugin"
    setting: str | None = None  # trainer.<setting> says what a verdict does

    def begin(self, step: int) -> None:
        return None

    def abort(self) -> None:
        return None

    def before_reduce(self) -> None:
        return None

    def after_clip(self, step: int, replay: Replay) -> None:
        return None

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def hand(self) -> torch.Tensor | None:
        return None

    def take(self, values: list[float]) -> None:
        return None

    def verdict(self, step: int) -> str | None:
        return None

    def after_update(self, step: int, applied: bool) -> None:
        return None

    def metrics(self) -> dict:
        return {}


class GradientFlags(StepPlugin):
    """Which parameters some dp rank gave a gradient (ZeRO-0's buckets, ZeRO-1's shards): read back with the
    step's values instead of on their own, and applied before the optimizer steps."""

    name = "grad_flags"

    def __init__(self, optimizer: DataParallelOptimizer):
        self.optimizer = optimizer

    def hand(self) -> torch.Tensor | None:
        return self.optimizer.device_flags()

    def take(self, values: list[float]) -> None:
        self.optimizer.apply_flags(values)


class MoEStats(StepPlugin):
    """Routing statistics of every MoE layer over the global batch (``training.moe_stats``): one table read
    back, the balancing bias moved from it when the update is applied, the metrics reported."""

    name = "moe"

    def __init__(self, stats: MoEStatistics, device: torch.device):
        self.stats, self.device = stats, device
        self._table: torch.Tensor | None = None
        self._values: list[float] | None = None

    def begin(self, step: int) -> None:
        self.stats.begin_step()
        self._table = self._values = None

    def before_reduce(self) -> None:
        self._table = self.stats.table(self.device)

    @contextlib.contextmanager
    def replaying(self):
        """Around a rerun of the step's first micro-batch: not counted, and what it routed forgotten after."""
        with self.stats.replaying():
            yield
        self.stats.discard()  # the rerun's routing is not the step's

    def hand(self) -> torch.Tensor | None:
        return self._table

    def take(self, values: list[float]) -> None:
        self._values = values

    def after_update(self, step: int, applied: bool) -> None:
        if applied and self._table is not None:
            self.stats.apply_bias(self._table)  # the same global loads on every rank: the same bias

    def metrics(self) -> dict:
        return {"moe": self.stats.metrics(self._values)} if self._values is not None else {}


class MTPStats(StepPlugin):
    """Multi-token prediction's per-depth losses and predicted tokens over the global batch: one world
    all-reduce of a [2D] table (the last stage's tp-rank-0 ranks contribute), read back with the step's values.
    ``mtp.loss[k]`` is depth k+1's mean loss (unweighted), ``mtp.tokens`` the positions all depths predicted."""

    name = "mtp"

    def __init__(self, chunks, groups, depth: int, device: torch.device):
        self.groups, self.depth, self.device = groups, depth, device
        self.mtp = chunks[-1].mtp if chunks[-1].last else None
        self._table: torch.Tensor | None = None
        self._values: list[float] | None = None

    def begin(self, step: int) -> None:
        self._table = self._values = None
        if self.mtp is not None:
            self.mtp.take()  # a failed or replayed step's leftovers are not this step's

    def before_reduce(self) -> None:
        table = torch.zeros(2 * self.depth, dtype=torch.float64, device=self.device)
        taken = self.mtp.take() if self.mtp is not None else None
        if taken is not None and self.groups.tp_rank == 0:
            losses, tokens, calls = taken
            replicas = self.groups.layout.dp * self.groups.layout.cp
            table[: self.depth] = losses.double() / (calls * replicas)
            table[self.depth :] = tokens.double()
        if self.groups.layout.world_size > 1:
            collectives.all_reduce(table, None)
        self._table = table

    def hand(self) -> torch.Tensor | None:
        return self._table

    def take(self, values: list[float]) -> None:
        self._values = values

    def metrics(self) -> dict:
        if self._values is None:
            return {}
        d = self.depth
        return {"mtp": {"loss": self._values[:d], "tokens": int(sum(self._values[d:]))}}


class GradientOutliers(StepPlugin):
    """The dp-replica outlier check (``training.outliers``) on the local gradients, before they are mixed: the
    optimizer shows them segment by segment (``DataParallelOptimizer.local_gradients``), zero-0's buckets while
    backward still runs."""

    name = "grad_outliers"
    setting = "grad_outlier_action"

    def __init__(self, optimizer: DataParallelOptimizer, groups, cosine_gap: float, norm_max: float):
        sizes, self._flush = optimizer.local_gradients(self._add)
        device = optimizer.params_with_info[0][0].device
        self._check = GradientOutlierCheck(sizes, device, groups, cosine_gap, norm_max)
        self._stats: torch.Tensor | None = None
        self._values: list[float] | None = None

    def _add(self, segment: int, grad: torch.Tensor) -> None:
        self._check.add(segment, grad)

    def begin(self, step: int) -> None:
        self._check.reset()  # also drops what a failed step's buckets showed

    def before_reduce(self) -> None:
        self._flush()
        self._stats, self._values = self._check.stats(), None

    def hand(self) -> torch.Tensor | None:
        return self._stats

    def take(self, values: list[float]) -> None:
        self._values = values

    def verdict(self, step: int) -> str | None:
        return None if self._values is None else self._check.verdict(self._values, step)


class SilentCorruption(StepPlugin):
    """Every ``every`` steps, the first micro-batch rerun and compared bit for bit (``training.sdc``)."""

    name = "sdc"
    setting = "sdc_action"

    def __init__(self, check: SilentCorruptionCheck, every: int, moe: MoEStats | None = None):
        self.check, self.every, self.moe = check, every, moe
        self._checking = False
        self._finding: str | None = None

    def begin(self, step: int) -> None:
        self._checking, self._finding = (step + 1) % self.every == 0, None
        if self._checking:
            self.check.arm()

    def abort(self) -> None:
        if self._checking:
            self.check.disarm()

    def after_clip(self, step: int, replay: Replay) -> None:
        if not self._checking:
            return
        with self.moe.replaying() if self.moe is not None else contextlib.nullcontext():
            self._finding = replay(lambda inputs, targets: self.check.rerun(inputs, targets, step))

    def verdict(self, step: int) -> str | None:
        return self._finding


__all__ = ["GradientFlags", "GradientOutliers", "MoEStats", "Replay", "SilentCorruption", "StepPlugin"]
