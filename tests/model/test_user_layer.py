"""A user's own sharded layer, built from the public layers and tested against its single-device twin."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelpar import ParallelLayout
from modelpar.model.layers import ColumnParallelLinear, RowParallelLinear
from modelpar.parallel.regions import TensorParallelGroup
from modelpar.testing import current_groups

HIDDEN, FFN = 12, 20
TOL = 1e-6


class ShardedMLP(nn.Module):
    """``down(gelu(up(x)))``, the FFN features split over tp: x [b, s, hidden] -> [b, s, hidden] on every rank."""

    def __init__(self, hidden: int, ffn: int, tp: TensorParallelGroup):
        super().__init__()
        self.up = ColumnParallelLinear(hidden, ffn, tp)  # rank r: rows r*ffn/t .. (r+1)*ffn/t of up [ffn, hidden]
        self.down = RowParallelLinear(ffn, hidden, tp)  # rank r: the same columns of down [hidden, ffn]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one all-reduce forward (after down), one backward (before up)
        return self.down(F.gelu(self.up(x)))


def _forward_backward(tp: TensorParallelGroup):
    """(mlp, y, dx) of the MLP on ``tp``."""
    g = torch.Generator().manual_seed(0)  # the same full weights, input and output gradient on every rank
    up, down = torch.randn(FFN, HIDDEN, generator=g) / HIDDEN**0.5, torch.randn(HIDDEN, FFN, generator=g) / FFN**0.5
    x, grad_y = torch.randn(2, 5, HIDDEN, generator=g).requires_grad_(), torch.randn(2, 5, HIDDEN, generator=g)
    mlp = ShardedMLP(HIDDEN, FFN, tp)
    mlp.up.load_full(up)
    mlp.down.load_full(down)
    y = mlp(x)
    y.backward(grad_y)
    return mlp, y.detach(), x.grad


@pytest.mark.ranks(2, layout=ParallelLayout(tp=2))
def test_sharded_mlp_equals_its_single_device_twin():
    mlp, y, dx = _forward_backward(TensorParallelGroup.of(current_groups()))
    twin, twin_y, twin_dx = _forward_backward(TensorParallelGroup())  # tp=1: plain full-size linears
    torch.testing.assert_close(y, twin_y, rtol=TOL, atol=TOL)
    torch.testing.assert_close(dx, twin_dx, rtol=TOL, atol=TOL)
    for shards, full in ((mlp.up, twin.up), (mlp.down, twin.down)):
        (shard,) = shards.logical_shards().values()  # this rank's rows of up, columns of down
        torch.testing.assert_close(shard.grad, full.weight.grad[shard.index], rtol=TOL, atol=TOL)
