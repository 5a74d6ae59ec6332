"""``build_optimizer``: the ``DataParallelOptimizer`` of a ZeRO stage (``optim.zero``)."""

from __future__ import annotations

from modelpar.optim.data_parallel import (
    ZERO_STAGES,
    DataParallelOptimizer,
    ReplicatedAdamW,
    ZeroOneOptimizer,
)
from modelpar.optim.fsdp import FullyShardedAdamW
from modelpar.optim.grad_sync import DEFAULT_BUCKET_BYTES
from modelpar.optim.muon_layout import MuonLayout
from modelpar.optim.param_info import ParamsWithInfo
from modelpar.parallel.groups import ParallelGroups


def build_optimizer(
    params_with_info: ParamsWithInfo,
    groups: ParallelGroups,
    *,
    zero: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    chunks: list | None = None,
    reduce_every_micro_batch: bool = False,
    muon_layout: MuonLayout | None = None,
) -> DataParallelOptimizer:
    """The optimizer of ZeRO stage ``zero`` (0 to 3) over ``groups``' dp group; with ``muon_layout``, Muon for
    the matrices it covers (``modelpar.optim.muon_layout``), AdamW for the rest."""
    adam = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, muon_layout=muon_layout)
    if zero == 0:
        return ReplicatedAdamW(params_with_info, groups, bucket_bytes=bucket_bytes, **adam)
    if zero == 1:
        return ZeroOneOptimizer(params_with_info, groups, **adam)
    if zero in (2, 3):  # the parameters were sharded by ``modelpar.model.parallelize.apply_fsdp``
        return FullyShardedAdamW(
            params_with_info,
            groups,
            chunks=chunks or [],
            reduce_every_micro_batch=reduce_every_micro_batch,
            zero=zero,
            **adam,
        )
    raise ValueError(f"optim.zero={zero} is not a supported ZeRO stage; choose one of {ZERO_STAGES}")
