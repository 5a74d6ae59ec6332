"""Muon's arithmetic: momentum, Newton-Schulz orthogonalisation, the learning-rate adjustment by shape.

The same operations, in the same order and dtype, as ``torch.optim.Muon`` (torch 2.13), which the tests hold
it to. Per step of one 2-D matrix ``W`` with gradient ``G`` and momentum buffer ``B``::

    B <- lerp(B, G, 1 - momentum)                      # B = momentum * B + (1 - momentum) * G
    U <- lerp(G, B, momentum) if nesterov else B
    O <- NS_k(U)                                        # k quintic Newton-Schulz steps, in ``ns_dtype``
    W <- W * (1 - lr * weight_decay) - lr * ratio(A, B) * O

``ratio``: ``original`` is sqrt(max(1, rows/cols)); ``match_rms_adamw`` (the default here, Moonlight) is
0.2 * sqrt(max(rows, cols)), which gives the update AdamW's RMS, so AdamW's learning rate and weight decay
carry over. Where the matrix lives (tp shards, ZeRO segments, experts) is ``modelpar.optim.muon_layout``'s.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c), as torch.optim.Muon's defaults
ADJUST_LR = ("original", "match_rms_adamw")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# logical tensors AdamW keeps even though they are 2-D: the embedding, the output head, a MoE router
DEFAULT_ADAMW_FOR = ("embed_tokens.*", "*embed_tokens.weight", "lm_head.*", "*.mlp.gate.weight")


@dataclass(frozen=True)
class MuonSettings:
    """Muon's hyper-parameters (``optim.muon_*``); ``lr_scale``: Muon's learning rate over AdamW's."""

    lr_scale: float = 1.0
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = 1e-7
    adjust_lr: str = "match_rms_adamw"
    ns_dtype: str = "bf16"
    adamw_for: tuple[str, ...] = DEFAULT_ADAMW_FOR
    # > 0: q_proj, k_proj and v_proj orthogonalised per head, each block of this many rows its own matrix
    per_head_rows: int = 0

    def uses_muon(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the logical tensor ``name`` is updated by Muon: a 2-D matrix no ``adamw_for`` pattern names."""
        return len(shape) == 2 and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.adamw_for)


PER_HEAD = ("*.q_proj.weight", "*.k_proj.weight", "*.v_proj.weight")  # grouped-query attention's, by name


def split_rows(settings: MuonSettings, name: str, shape: tuple[int, int]) -> int:
    """The rows of each block orthogonalised on its own: a head's (``per_head_rows``) for q/k/v when asked, else
    the whole matrix's."""
    if settings.per_head_rows and any(fnmatch.fnmatchcase(name, p) for p in PER_HEAD):
        if shape[0] % settings.per_head_rows:
            raise ValueError(f"{name} {shape} does not split into heads of {settings.per_head_rows} rows")
        return settings.per_head_rows
    return shape[0]


def adjust_ratio(adjust_lr: str, shape: tuple[int, ...]) -> float:
    """The factor Muon's learning rate is multiplied by for a matrix of ``shape`` (rows, cols)."""
    rows, cols = shape[:2]
    if adjust_lr == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"optim.muon_adjust_lr={adjust_lr!r} is not one of {ADJUST_LR}")


def newton_schulz(update: torch.Tensor, settings: MuonSettings) -> torch.Tensor:
    """The orthogonalised ``update`` (2-D): ``ns_steps`` quintic iterations on the wide orientation, in
    ``ns_dtype``, after scaling to Frobenius norm 1 (so the spectral norm is at most 1)."""
    a, b, c = settings.ns_coefficients
    x = update.to(NS_DTYPES[settings.ns_dtype], copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=settings.eps))
    for _ in range(settings.ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def newton_schulz_batched(updates: torch.Tensor, settings: MuonSettings) -> torch.Tensor:
    """``newton_schulz`` of each matrix of ``updates`` ([batch, rows, cols]) at once, by batched matmuls (one
    call per iteration for all of them instead of one each): each matrix scaled by its own Frobenius norm."""
    a, b, c = settings.ns_coefficients
    x = updates.to(NS_DTYPES[settings.ns_dtype], copy=True)
    tall = updates.size(-2) > updates.size(-1)
    if tall:
        x = x.mT
    x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=settings.eps))
    for _ in range(settings.ns_steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def newton_schulz_flops(shape: tuple[int, ...], ns_steps: int) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of ``newton_schulz`` on a matrix of ``shape``: per step the Gram
    matrix (m x n x m), its square (m^3) and the update (m x m x n), m the short side."""
    m, n = sorted(shape[:2])
    return ns_steps * 2 * (2 * m * m * n + m**3)


def least_loaded_owners(costs: list[int], ranks: int) -> tuple[list[int], list[int]]:
    """(The owner of each matrix, each rank's load): the matrices taken in the order given (the engine's: largest
    Newton-Schulz FLOPs first), each to the rank least loaded so far by ``costs`` (ties: the lowest index)."""
    loads, owners = [0] * ranks, []
    for cost in costs:
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners.append(rank)
        loads[rank] += cost
    return owners, loads


def momentum_update(
    param_grad: torch.Tensor, buf: torch.Tensor, settings: MuonSettings, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Advance the momentum buffer ``buf`` in place; the update to orthogonalise (elementwise: any shard of a
    matrix gives the same values as the whole), written into ``out`` (shaped like the gradient) when given."""
    buf.lerp_(param_grad, 1 - settings.momentum)
    if out is None:
        return param_grad.lerp(buf, settings.momentum) if settings.nesterov else buf
    if settings.nesterov:
        return torch.lerp(param_grad, buf, settings.momentum, out=out)
    return out.copy_(buf)


__all__ = [
    "ADJUST_LR",
    "DEFAULT_ADAMW_FOR",
    "MuonSettings",
    "NS_COEFFICIENTS",
    "NS_DTYPES",
    "adjust_ratio",
    "momentum_update",
    "newton_schulz",
    "newton_schulz_batched",
    "newton_schulz_flops",
    "split_rows",
]
