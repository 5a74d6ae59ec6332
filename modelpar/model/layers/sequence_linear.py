"""The column-parallel matmul under sequence parallelism that keeps only this rank's sequence shard for backward.

    forward    x_r [b, s/t, in] --all-gather--> x [b, s, in];  y_r = x @ W_r.T  [b, s, out/t]
               saved: x_r (the 1/t shard) and W_r, not the gathered x
    backward   all-gather x_r again (posted)  |  dx = dy @ W_r    (computed while the gather runs)
               wait; reduce-scatter dx (posted)  |  dW_r = dy.T @ x   (computed while it runs); wait

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.2.2): the
gathered input ``[T, in]`` is what the weight gradient needs, and keeping it costs ``t`` times the shard. Kept
whole (``F.linear(all_gather(x))``), it is ``e*T*in`` bytes per column-parallel linear per micro-batch in
flight; kept as the shard, ``e*T/t*in``, for one more all-gather per linear in backward, overlapped with the
input-gradient matmul.

Under autocast the shard is cast to the compute dtype before the gather (what ``F.linear`` would have cast the
gathered tensor to: the same numbers, half the bytes sent and kept); the input gradient is reduce-scattered in
the input's dtype, as the gather-then-linear path does. With ``fp8`` the two backward GEMMs run in FP8 as in
``modelpar.model.layers.fp8`` (the input kept in its own precision, quantized again from the re-gathered
tensor; the forward's scales reused where tensorwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from modelpar.model.layers.fp8 import Fp8Scaling, compute_dtype, fp8_forward, fp8_input_grad, fp8_weight_grad
from modelpar.parallel.collectives import (
    all_gather,
    all_gather_async,
    comm_tag,
    current_tag,
    reduce_scatter_async,
    wait_after_hand_over,
)
from modelpar.parallel.regions import TensorParallelGroup

SEQUENCE_DIM = 1  # [b, s/t, in]


class _SequenceParallelColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, tp, fp8):
        ctx.tp, ctx.fp8, ctx.tag, ctx.in_dtype = tp, fp8, current_tag(), x.dtype
        if fp8 is None:
            shard = x.to(compute_dtype(x))
            full = all_gather(shard, tp.group, SEQUENCE_DIM)
            y = F.linear(full, weight.to(shard.dtype))
            ctx.save_for_backward(shard, weight)
            return y
        full = all_gather(x, tp.group, SEQUENCE_DIM)
        y, sx, sw = fp8_forward(full.reshape(-1, full.shape[-1]), weight, fp8, compute_dtype(x))
        ctx.save_for_backward(x, weight, sx, sw)
        return y.reshape(*full.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        shard, weight, *scales = ctx.saved_tensors
        tp, fp8 = ctx.tp, ctx.fp8
        grad_y = grad_y.contiguous()
        flat_grad = grad_y.reshape(-1, grad_y.shape[-1])
        with comm_tag(ctx.tag):
            gathering, full = all_gather_async(shard, tp.group, SEQUENCE_DIM)
        sx, sw = scales if fp8 is not None else (None, None)
        sg = grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # while the gather is in flight
            if fp8 is None:
                grad_full = torch.matmul(grad_y, weight.to(grad_y.dtype))
            else:
                with comm_tag(ctx.tag):
                    dx, sg = fp8_input_grad(flat_grad, weight, fp8, grad_y.dtype, sw)
                grad_full = dx.reshape(*grad_y.shape[:-1], weight.shape[1])
            with comm_tag(ctx.tag):
                wait_after_hand_over(gathering, "all_gather", tp.group)
                scattering, grad_x = reduce_scatter_async(grad_full.to(ctx.in_dtype), tp.group, SEQUENCE_DIM)
        else:
            with comm_tag(ctx.tag):
                wait_after_hand_over(gathering, "all_gather", tp.group)
        if ctx.needs_input_grad[1]:  # while the reduce-scatter is in flight
            flat_x = full.reshape(-1, full.shape[-1])
            if fp8 is None:
                grad_w = torch.matmul(flat_grad.t(), flat_x.to(grad_y.dtype)).to(weight.dtype)
            else:
                with comm_tag(ctx.tag):
                    grad_w = fp8_weight_grad(flat_grad, flat_x, fp8, grad_y.dtype, sg, sx).to(weight.dtype)
        if grad_x is not None:
            with comm_tag(ctx.tag):
                wait_after_hand_over(scattering, "reduce_scatter", tp.group)
        return grad_x, grad_w, None, None


def sequence_parallel_column_linear(
    x: torch.Tensor, weight: torch.Tensor, tp: TensorParallelGroup, fp8: Fp8Scaling | None = None
) -> torch.Tensor:
    """``all_gather(x) @ weight.T`` keeping only ``x`` (the sequence shard) for backward: x [b, s/t, in],
    weight [out/t, in] -> [b, s, out/t]; ``fp8``: all three GEMMs in FP8 under that scaling."""
    return _SequenceParallelColumnLinear.apply(x, weight, tp, fp8)


__all__ = ["sequence_parallel_column_linear"]
