"""Optimizer state as named tensors, for safetensors checkpoints (never pickle).

Plain AdamW: ``exp_avg/<name>``, ``exp_avg_sq/<name>``, ``step/<name>`` per parameter that has been stepped,
``<name>`` from its ``ParamInfo``. ZeRO-1: this rank's shard buffers (``ZeroOneAdamW.state_tensors``). The
hyperparameters are not state: the learning rate is set from the schedule before every step.
"""

from __future__ import annotations

import torch

from modelpar.optim.zero import ZeroOneAdamW

ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _named_params(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str]]:
    named = []
    for group in opt.param_groups:
        if "param_names" not in group:
            raise ValueError("optimizer parameters have no names: build it with modelpar.optim.build_adamw")
        named.extend(zip(group["params"], group["param_names"], strict=True))
    return named


def optimizer_state_tensors(opt: torch.optim.Optimizer | ZeroOneAdamW) -> dict[str, torch.Tensor]:
    """A CPU copy of the optimizer's state, keyed ``<kind>/<param name>`` (or ``zero/<kind>`` for ZeRO-1)."""
    if isinstance(opt, ZeroOneAdamW):
        return opt.state_tensors()
    tensors = {}
    for p, name in _named_params(opt):
        state = opt.state.get(p)
        if state:
            for kind in ADAMW_KEYS:
                tensors[f"{kind}/{name}"] = state[kind].detach().to("cpu", copy=True)
    return tensors


@torch.no_grad()
def load_optimizer_state_tensors(opt: torch.optim.Optimizer | ZeroOneAdamW, tensors: dict[str, torch.Tensor]) -> None:
    """Restore ``optimizer_state_tensors`` output; the next ``step()`` continues bit-identically.

    Parameters absent from ``tensors`` start fresh (never stepped); a key naming no parameter is an error.
    """
    if isinstance(opt, ZeroOneAdamW):
        opt.load_state_tensors(tensors)
        return
    named = _named_params(opt)
    expected = {f"{kind}/{name}" for _, name in named for kind in ADAMW_KEYS}
    unknown = sorted(set(tensors) - expected)
    if unknown:
        raise KeyError(f"optimizer state has keys for no parameter of this optimizer: {unknown[:5]}")
    for p, name in named:
        present = [f"{kind}/{name}" in tensors for kind in ADAMW_KEYS]
        if not any(present):
            opt.state.pop(p, None)
            continue
        if not all(present):
            raise KeyError(f"optimizer state of {name!r} needs all of {[f'{k}/{name}' for k in ADAMW_KEYS]}")
        for kind in ("exp_avg", "exp_avg_sq"):
            if tensors[f"{kind}/{name}"].shape != p.shape:
                raise ValueError(
                    f"{kind}/{name} has shape {tuple(tensors[f'{kind}/{name}'].shape)}, parameter {tuple(p.shape)}"
                )
        opt.state[p] = {
            "step": tensors[f"step/{name}"].clone(),
            "exp_avg": tensors[f"exp_avg/{name}"].to(p.device, p.dtype, copy=True),
            "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(p.device, p.dtype, copy=True),
        }
