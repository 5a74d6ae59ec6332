"""Tensor-parallel gated feed-forward block: SwiGLU (Llama) or GeGLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from modelpar_kernels import swiglu
from torch import nn

from modelpar.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from modelpar.model.layers.shard import ColumnPart, ShardInfo
from modelpar.parallel.context import ContextParallelGroup
from modelpar.parallel.regions import TensorParallelGroup


class ParallelSwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused in one column-parallel weight and down
    row-parallel, so the block costs one f (entry) and one g (exit)::

        x [b, s, h] --f--> gate_up_proj [2f/t, h] -> gate_r, up_r [b, s, f/t] -> silu(gate_r) * up_r
                    --> down_proj [h, f/t] --g--> [b, s, h]

    ``fp8`` (off | rowwise | tensorwise): both projections' GEMMs in FP8, scales reduced over tp and ``cp``.
    ``activation`` geglu: ``gelu_tanh(gate) * up`` instead (Gemma), on the torch path whatever the backend (the
    fused kernel is SwiGLU's).
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        tp: TensorParallelGroup,
        *,
        sequence_parallel: bool = False,
        backend: str = "torch",
        fp8: str = "off",
        cp: ContextParallelGroup | None = None,
        activation: str = "swiglu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.backend, self.activation = backend, activation
        parts = [ColumnPart.even(name, ffn_hidden, tp.rank, tp.size) for name in ("gate_proj.weight", "up_proj.weight")]
        kw = dict(sequence_parallel=sequence_parallel, fp8=fp8, cp=cp, device=device, dtype=dtype)
        self.gate_up_proj = ColumnParallelLinear(hidden, parts, tp, **kw)
        self.down_proj = RowParallelLinear(ffn_hidden, hidden, tp, name="down_proj.weight", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, h] (or [b, s/t, h] with sequence parallel) -> same shape."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.activation == "geglu":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(swiglu(gate, up, backend=self.backend))

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        return self.gate_up_proj.logical_shards(prefix) | self.down_proj.logical_shards(prefix)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gated activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = gate
    clamped above at ``limit``. gate, up: [..., f] -> [..., f]."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)
