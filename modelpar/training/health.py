"""Health checks that run inside training: loss guard, replica drift, stragglers.

- ``LossGuard``: a non-finite loss or gradient norm, or a loss spike, skips the step on every rank together
  (the decision is made from values all ranks share) or halts, as configured.
- ``find_drift``: parameters that must be identical (across dp replicas, tp-replicated norms and kv heads, the
  tied embedding on first and last stage) are compared by checksum; a mismatch names the rank and parameter.
- ``find_stragglers``: each rank's compute time in the step, gathered over the world; a rank slower than the
  median by a factor is named.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist


class HealthError(RuntimeError):
    """Training halted by a health check; the message names the cause."""

    one_line = True  # the launcher reports the message alone: the traceback would only bury it


@dataclass
class LossGuard:
    """Decides whether a step's update is applied. ``spike_factor <= 0`` disables the spike check."""

    nonfinite: str = "skip"  # skip | halt
    spike_factor: float = 0.0
    spike_action: str = "skip"
    window: int = 20

    def __post_init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=self.window)
        self.skipped = 0

    def check(self, step: int, loss: float, grad_norm: float) -> str | None:
        """None to apply the step, else the reason it is skipped; raises ``HealthError`` to halt."""
        reason = None
        action = "skip"
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            reason, action = f"non-finite loss {loss} or gradient norm {grad_norm}", self.nonfinite
        elif self.spike_factor > 0 and len(self.recent) >= min(5, self.window):
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                reason = f"loss spike {loss:.4f} > {self.spike_factor} x recent mean {mean:.4f}"
                action = self.spike_action
        if reason is None:
            self.recent.append(loss)
            return None
        if action == "halt":
            raise HealthError(f"step {step}: {reason}; halting (trainer.nonfinite / trainer.spike_action=halt)")
        self.skipped += 1
        return reason


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two float64 numbers that change with any value: sum and a position-weighted sum."""
    flat = tensor.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack((flat.sum(), (flat * weights).sum()))


def find_drift(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, ranks: list[int]) -> list[str]:
    """Compare checksums of ``named`` tensors over ``group`` (whose members must hold identical values).

    Returns one line per mismatch naming the parameter and the ranks that disagree with the lowest rank.
    Collective over ``group``; every member must pass the same names in the same order.
    """
    if len(ranks) <= 1 or not named:
        return []
    mine = torch.stack([checksum(t) for _, t in named])  # [n, 2]
    everyone = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(everyone, mine, group=group)
    problems = []
    for i, (name, _) in enumerate(named):
        reference = everyone[0][i]
        bad = [r for r, theirs in zip(ranks, everyone, strict=True) if not torch.equal(theirs[i], reference)]
        if bad:
            problems.append(f"{name} on rank(s) {bad} differs from rank {ranks[0]}")
    return problems


def find_stragglers(compute_s: float, factor: float) -> tuple[list[int], list[float]]:
    """All-gather every rank's compute time; the ranks slower than ``factor`` x the (low) median, and the times."""
    world = dist.get_world_size()
    mine = torch.tensor([compute_s], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    times = [t.item() for t in everyone]
    median = statistics.median_low(times)  # with two ranks, the faster one: the mean would hide a slow one
    slow = [r for r, t in enumerate(times) if median > 0 and t > factor * median]
    return slow, times
