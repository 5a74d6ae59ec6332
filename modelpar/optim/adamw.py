"""AdamW with weight decay only where ``ParamInfo.decay`` says so."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from modelpar.optim.muon_adamw import MuonAdamW, muon_piece
from modelpar.optim.muon_layout import MuonLayout
from modelpar.optim.param_info import ParamsWithInfo, check_unique


def make_adamw(
    tensors: Sequence[tuple[torch.Tensor, str, bool]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    muon: tuple[MuonLayout, dict[int, tuple]] | None = None,
) -> torch.optim.AdamW:
    """torch's AdamW over ``(tensor, name, decay)`` triples, as a decay group and a no-decay group.

    ``muon``: a ``MuonLayout`` and the ``muon_piece`` of each tensor it updates (by id): those form a third
    group, updated by Muon (``MuonAdamW``) with the layout's weight decay and learning-rate scale.

    The plain and the ZeRO-1 optimizer both build through here. Both groups always exist (possibly empty) so
    every rank has the same ``param_groups``. torch picks its for-loop implementation on CPU and ``foreach`` on
    CUDA; either is elementwise, so a parameter updated whole or in ZeRO shards gets the same arithmetic.
    """
    pieces = {} if muon is None else muon[1]
    adam = [(t, name, decay) for t, name, decay in tensors if id(t) not in pieces]
    groups = [
        {
            "params": [t for t, _, decay in adam if decay == wanted],
            "param_names": [name for _, name, decay in adam if decay == wanted],
            "weight_decay": weight_decay if wanted else 0.0,
        }
        for wanted in (True, False)
    ]
    if muon is None:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    layout = muon[0]
    groups.append(
        {
            "params": [t for t, _, _ in tensors if id(t) in pieces],
            "param_names": [name for t, name, _ in tensors if id(t) in pieces],
            "weight_decay": layout.settings.weight_decay,
            "lr_scale": layout.settings.lr_scale,
            "muon": True,
        }
    )
    return MuonAdamW(groups, layout=layout, muon_pieces=pieces, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def build_adamw(
    params_with_info: ParamsWithInfo,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    muon_layout: MuonLayout | None = None,
    rows: Callable[[torch.Tensor], slice] | None = None,
) -> torch.optim.AdamW:
    """AdamW on whole parameters, each named by its ``ParamInfo`` (the names key its checkpoint state).

    Pair it with ``GradientSynchronizer`` when dp > 1. ``muon_layout``: the parameters it covers are updated
    by Muon instead; ``rows(param)``: the rows of the tp-local tensor this rank's piece of ``param`` holds (its
    FSDP2 dp shard), when not all of them.
    """
    check_unique([p for p, _ in params_with_info])
    muon = None
    if muon_layout is not None:
        pieces = {
            id(p): muon_piece(muon_layout, p, rows=None if rows is None else rows(p))
            for p, _ in params_with_info
            if muon_layout.is_muon(p)
        }
        muon = (muon_layout, pieces)
    return make_adamw(
        [(p, info.name, info.decay) for p, info in params_with_info],
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        muon=muon,
    )
