"""What the optimizer needs to know about a parameter besides its tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the optimizer sees it.

    ``norm_share`` is the fraction of this parameter's squared-gradient sum that this rank adds to the global
    gradient norm, chosen so that every parameter counts exactly once over tp and pp: 1.0 for a tp-sharded
    weight, ``1/tp`` for a weight replicated over tp (a norm), 0.0 for the tied embedding's copy on the last
    pipeline stage.
    """

    name: str
    decay: bool
    norm_share: float = 1.0


ParamsWithInfo = Sequence[tuple[torch.Tensor, ParamInfo]]


def default_decay(name: str, param: torch.Tensor) -> bool:
    """Weight decay for matrices only: 1-D parameters (norm weights, biases) are not decayed."""
    return param.dim() >= 2


def check_unique(params: Sequence[torch.Tensor]) -> None:
    """A parameter listed twice would be updated twice; tied weights must be passed once."""
    seen: set[int] = set()
    for i, p in enumerate(params):
        if id(p) in seen:
            raise ValueError(f"parameter #{i} {tuple(p.shape)} is listed twice; pass tied weights once")
        seen.add(id(p))
