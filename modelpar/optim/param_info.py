"""What the optimizer needs to know about a parameter besides its tensor."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelpar.parallel import collectives


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the optimizer sees it.

    ``norm_share`` is the fraction of this parameter's squared-gradient sum that this rank adds to the global
    gradient norm, chosen so that every parameter counts exactly once over tp and pp: 1.0 for a tp-sharded
    weight, ``1/tp`` for a weight replicated over tp (a norm), 0.0 for the tied embedding's copy on the last
    pipeline stage. A 1-D tensor gives one share per row (dim 0) instead: a fused weight such as q/k/v whose
    k/v rows are replicated over tp while its q rows are sharded.

    ``expert_parallel``: the parameter holds this rank's experts of a MoE layer, split over the ep group: its
    gradient is averaged over the expert data-parallel ranks (those holding the same experts) instead of all
    of dp x cp, and its norm is summed over ep.

    ``uses``: how many of this rank's model chunks hold the parameter, each running its own backward per
    micro-batch (2 for a tied embedding whose two ends are chunks of one rank, as the V placement puts them).
    """

    name: str
    decay: bool
    norm_share: float | torch.Tensor = 1.0
    expert_parallel: bool = False
    uses: int = 1


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


def check_same_across(params: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` must list the same shapes and dtypes in the same order.

    Buckets and ZeRO shards are cut from that order; ranks that disagree would pair unrelated collectives and
    fail (or worse, not fail) far from the cause. One all-gather of a 3-number fingerprint, at construction.
    """
    if dist.get_world_size(group) == 1:
        return
    layout = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    mine = [len(params), sum(p.numel() for p in params), zlib.crc32(layout.encode())]
    device = params[0].device if params else torch.device("cpu")
    everyone = collectives.all_gather(torch.tensor(mine, dtype=torch.int64, device=device), group).view(-1, 3).tolist()
    differing = [rank for rank, theirs in enumerate(everyone) if theirs != mine]
    if differing:
        raise ValueError(
            f"parameter lists differ across data-parallel ranks (this rank: {mine[0]} tensors, {mine[1]} elements; "
            f"group ranks {differing} differ): pass parameters in the same (model) order on every rank"
        )
