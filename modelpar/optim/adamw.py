"""AdamW with weight decay only where ``ParamInfo.decay`` says so."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from modelpar.optim.param_info import ParamsWithInfo, check_unique


def make_adamw(
    tensors: Sequence[tuple[torch.Tensor, str, bool]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.optim.AdamW:
    """torch's AdamW over ``(tensor, name, decay)`` triples, as a decay group and a no-decay group.

    The plain and the ZeRO-1 optimizer both build through here. Both groups always exist (possibly empty) so
    every rank has the same ``param_groups``. torch picks its for-loop implementation on CPU and ``foreach`` on
    CUDA; either is elementwise, so a parameter updated whole or in ZeRO shards gets the same arithmetic.
    """
    groups = [
        {
            "params": [t for t, _, decay in tensors if decay == wanted],
            "param_names": [name for _, name, decay in tensors if decay == wanted],
            "weight_decay": weight_decay if wanted else 0.0,
        }
        for wanted in (True, False)
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def build_adamw(
    params_with_info: ParamsWithInfo,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
) -> torch.optim.AdamW:
    """AdamW on whole parameters, each named by its ``ParamInfo`` (the names key its checkpoint state).

    Pair it with ``GradientSynchronizer`` when dp > 1.
    """
    check_unique([p for p, _ in params_with_info])
    return make_adamw(
        [(p, info.name, info.decay) for p, info in params_with_info],
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
    )
