"""Learning rate: linear warm-up, then cosine decay to ``min_lr``."""

from __future__ import annotations

import math
from typing import Protocol


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_lr: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based: the step about to be taken).

    Counting ``n = step + 1`` updates: warm-up ramps ``base_lr * n / warmup`` up to ``base_lr`` at
    ``step = warmup - 1``; cosine then decays to ``min_lr``, reached at ``step = total - 1`` and held after.
    """
    if warmup < 0 or total < 1 or step < 0:
        raise ValueError(f"lr schedule needs step >= 0, warmup >= 0, total >= 1 (got {step}, {warmup}, {total})")
    if not 0 <= min_lr <= base_lr:
        raise ValueError(f"lr schedule needs 0 <= min_lr <= lr (got min_lr={min_lr}, lr={base_lr})")
    n = step + 1
    if n <= warmup:
        return base_lr * n / warmup
    if n >= total:
        return min_lr
    progress = (n - warmup) / (total - warmup)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class HasParamGroups(Protocol):
    """A torch optimizer or ``ZeroOneAdamW``."""

    param_groups: list[dict]


def set_lr(optimizer: HasParamGroups, lr: float) -> None:
    """Use ``lr`` for every parameter group (decay and no-decay alike) from the next ``step()`` on, times the
    group's ``lr_scale`` where it has one (Muon's group: its learning rate relative to AdamW's)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
