"""RMSNorm: replicated over the tp ranks, or over a projection's heads split by tp (OLMo 2's QK-norm)."""

from __future__ import annotations

import torch
from modelpar_kernels import rms_norm
from torch import nn

from modelpar.model.layers.shard import ShardInfo
from modelpar.parallel.regions import TensorParallelGroup, sum_over_tp


class RMSNorm(nn.Module):
    """``y = x / rms(x) * weight`` over the hidden dim (``offset`` 1: ``* (1 + weight)``, Gemma's); every tp rank
    holds the whole weight [h].

    Without sequence parallel each rank normalises the same full activations, so the weight gradient is
    already complete. With sequence parallel each rank sees only its [b, s/t, h] tokens: the gradient is
    partial (``ShardInfo.grad_is_partial``) and ``reduce_tensor_parallel_grads`` sums it over tp.
    ``partial_over_tp``: the gradient is partial at any tp > 1 (a norm over each head of this rank's heads,
    QK-norm), sequence parallel or not.
    """

    def __init__(
        self,
        hidden: int,
        eps: float,
        tp: TensorParallelGroup,
        *,
        name: str = "weight",
        sequence_parallel: bool = False,
        partial_over_tp: bool = False,
        offset: float = 0.0,
        backend: str = "torch",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.eps, self.name, self.tp, self.backend = eps, name, tp, backend
        self.sequence_parallel = sequence_parallel
        self.partial_over_tp, self.offset = partial_over_tp, offset
        self.weight = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., h] (the residual stream [b, s, h] or [b, s/t, h]; one head's [b, s, n, d]) -> same shape."""
        scale = self.weight + self.offset if self.offset else self.weight
        return rms_norm(x, scale, self.eps, backend=self.backend)

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        return {
            prefix + self.name: ShardInfo(
                param=self.weight,
                local_rows=slice(None),
                global_shape=tuple(self.weight.shape),
                replicated_over_tp=self.tp.size > 1,
                primary=self.tp.rank == 0,
                grad_is_partial=(self.sequence_parallel or self.partial_over_tp) and self.tp.size > 1,
            )
        }


class ProjectionRMSNorm(nn.Module):
    """One RMSNorm over a whole projection, all heads' concatenation [n*d] (OLMo 2's QK-norm), whose heads are
    split over tp: rank r holds the weight of its heads ``w[r*n*d/t : (r+1)*n*d/t]`` and normalises its slice of
    every token by the root mean square of the whole row, its sum of squares summed over tp (``sum_over_tp``)::

        x_r [b, s, n*d/t] -> ss = sum_tp(sum(x_r^2)) -> x_r * rsqrt(ss / (n*d) + eps) * w_r

    ``name``: the logical tensor (``q_norm.weight``); ``width`` n*d, ``local`` this rank's n*d/t from ``start``.
    """

    def __init__(
        self,
        width: int,
        start: int,
        local: int,
        eps: float,
        tp: TensorParallelGroup,
        *,
        name: str = "weight",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.width, self.start, self.eps, self.name, self.tp = width, start, eps, name, tp
        self.weight = nn.Parameter(torch.ones(local, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., n*d/t] -> same shape."""
        xf = x.float()
        mean_square = sum_over_tp(xf.pow(2).sum(-1, keepdim=True), self.tp) / self.width
        return (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype) * self.weight

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        return {
            prefix + self.name: ShardInfo(
                param=self.weight, local_rows=slice(None), global_shape=(self.width,), dim=0, offset=self.start
            )
        }
