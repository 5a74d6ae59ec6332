"""RMSNorm, replicated over the tp ranks."""

from __future__ import annotations

import torch
from modelpar_kernels import rms_norm
from torch import nn

from modelpar.model.layers.shard import ShardInfo
from modelpar.parallel.regions import TensorParallelGroup


class RMSNorm(nn.Module):
    """``y = x / rms(x) * weight`` over the hidden dim; every tp rank holds the whole weight [h].

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
        backend: str = "torch",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.eps, self.name, self.tp, self.backend = eps, name, tp, backend
        self.sequence_parallel = sequence_parallel
        self.partial_over_tp = partial_over_tp
        self.weight = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., h] (the residual stream [b, s, h] or [b, s/t, h]; one head's [b, s, n, d]) -> same shape."""
        return rms_norm(x, self.weight, self.eps, backend=self.backend)

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
