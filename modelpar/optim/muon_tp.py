"""Newton-Schulz distributed over the tp ranks that each hold a block of one matrix, instead of gathering it.

The other way to orthogonalise a tp-sharded matrix (``modelpar.optim.muon_exchange`` gathers it whole to one
owner). In the wide orientation ``X`` (m x n, m <= n; a tall matrix is transposed first) each quintic step is
``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. With ``X`` split over tp into blocks ``X_t``:

- along the long side n (column blocks): ``A = sum_t X_t X_t^T`` is one all-reduce of m x m, and every rank
  updates its own block, ``X_t <- a X_t + (b A + c A^2) X_t``;
- along the short side m (row blocks): the same step is ``X <- a X + X (b G + c G^2)`` with
  ``G = X^T X = sum_t X_t^T X_t``, an all-reduce of n x n, and ``X_t <- a X_t + X_t (b G + c G^2)``.

The Frobenius norm is one all-reduce of a scalar. Each rank does ``1/tp`` of the Gram and update products but
all of the m^3 (or n^3) polynomial, and ``ns_steps`` all-reduces of the Gram matrix move ``m^2`` (or ``n^2``)
elements each, where gathering moves the matrix's ``m n`` twice. Equal to ``newton_schulz`` of the whole
matrix up to rounding (fp32: 1e-5, tested); ``benchmarks/muon_tp.py`` measures both at tp2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from modelpar.optim.muon import NS_DTYPES, MuonSettings

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # the sum over the tp group (in place or not), returned


def newton_schulz_sharded(
    block: torch.Tensor, shape: tuple[int, int], dim: int, settings: MuonSettings, all_reduce: AllReduce
) -> torch.Tensor:
    """This rank's block of ``newton_schulz`` of the matrix of ``shape`` split over the tp group along ``dim``
    (0: rows, 1: columns), from its ``block`` of the update. Collective: every rank of the group calls it with
    its block of the same matrix."""
    a, b, c = settings.ns_coefficients
    x = block.to(NS_DTYPES[settings.ns_dtype], copy=True)
    tall = shape[0] > shape[1]
    if tall:
        x, dim = x.T, 1 - dim
    norm = all_reduce(x.float().square().sum().reshape(1)).sqrt().to(x.dtype)
    x = x / norm.clamp(min=settings.eps)
    for _ in range(settings.ns_steps):
        if dim == 1:  # column blocks of the wide matrix: the m x m Gram matrix
            gram = all_reduce(x @ x.T)
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
        else:  # row blocks: the n x n one, applied from the right
            gram = all_reduce(x.T @ x)
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, x, poly, beta=a)
    return x.T if tall else x


__all__ = ["AllReduce", "newton_schulz_sharded"]
