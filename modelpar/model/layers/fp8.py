"""FP8 GEMMs for the tensor-parallel linears: forward, input gradient and weight gradient through ``torch._scaled_mm``.

    y  = x @ W.T        [M, N] = q(x [M, K] along K)   . q(W [N, K] along K).T
    dx = g @ W          [M, K] = q(g [M, N] along N)   . q(W.T [K, N] along N).T
    dW = g.T @ x        [N, K] = q(g.T [N, M] along M) . q(x.T [K, M] along M).T

Every operand is quantized to float8 e4m3 (activations, weights and gradients alike: the scales are computed
from the tensor just before each GEMM, so e5m2's range is never needed and one format runs everywhere) with
``q(t) = clamp(t / s, -448, 448)`` in e4m3 and ``s = amax / 448`` (1 where amax is 0). The scale is

- ``tensorwise``: one scalar per operand, the amax of the whole tensor;
- ``rowwise``: one per row of the left operand and one per row of the right one (``_scaled_mm``'s column of
  mat2), the amax along the contraction dimension.

Layout invariance: an amax spans a dimension some group may split (the tokens ``M`` over cp, the input features
``K`` of a row-parallel weight over tp, the output features ``N`` of a column-parallel weight over tp), and is
all-reduced (MAX) over that group, so each rank quantizes its piece exactly as the single device quantizes the
whole: a tensorwise amax over the groups splitting either dimension of its tensor, a rowwise one over the group
splitting the contraction dimension. Data parallelism splits no tensor (a replica's micro-batch is the single
device's micro-batch of the same size), so nothing is reduced over dp.

Operands are padded with zeros to multiples of 16 in every dimension (what the GPU's FP8 GEMM needs; a zero
changes no amax and adds nothing to a product) and the left one is row-major, the right one column-major. The
products come out in the compute dtype (bf16 under autocast); the parameters and their gradients stay fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from modelpar.parallel.collectives import all_reduce, comm_tag, current_tag

FP8_MODES = ("off", "rowwise", "tensorwise")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
ALIGN = 16  # every dimension of a GEMM operand, padded with zeros

TOKENS, IN, OUT = "tokens", "in", "out"  # the dimensions an operand's two axes are


class SplitGroup(Protocol):
    """A group that splits a dimension (``TensorParallelGroup``, ``ContextParallelGroup``)."""

    group: dist.ProcessGroup | None
    size: int


@dataclass(frozen=True, eq=False)
class Fp8Scaling:
    """How one linear's GEMMs are scaled (``mode``: rowwise | tensorwise) and which group splits each of its
    dimensions: ``tokens`` (cp), ``inputs`` (tp of a row-parallel linear), ``outputs`` (tp of a column-parallel
    one); None: not split."""

    mode: str
    tokens: SplitGroup | None = None
    inputs: SplitGroup | None = None
    outputs: SplitGroup | None = None

    def __post_init__(self) -> None:
        if self.mode not in FP8_MODES[1:]:
            raise ValueError(f"fp8 scaling mode {self.mode!r} must be one of {FP8_MODES[1:]}")

    def split(self, dim: str) -> SplitGroup | None:
        return {TOKENS: self.tokens, IN: self.inputs, OUT: self.outputs}[dim]

    def amax(self, t: torch.Tensor, dims: tuple[str, str]) -> torch.Tensor:
        """t: [r, c] whose axes are the dimensions ``dims`` -> fp32 amax: [] (tensorwise) or [r, 1] (rowwise,
        along c), equal to the single device's whole tensor's."""
        if self.mode == "tensorwise":
            amax = t.abs().amax().float()
            reduced = dims
        else:
            amax = t.abs().amax(dim=1, keepdim=True).float()
            reduced = dims[1:]
        for dim in reduced:
            split = self.split(dim)
            if split is not None and split.size > 1:
                all_reduce(amax.reshape(-1), split.group, op=dist.ReduceOp.MAX)
        return amax


ScaledMM = Callable[..., torch.Tensor]  # torch._scaled_mm's arguments (scale_a=, scale_b=, out_dtype=) and result

_scaled_mm: ScaledMM = torch._scaled_mm


def install_gemm(gemm: ScaledMM | None) -> ScaledMM:
    """Multiply FP8 operands through ``gemm`` from now on (None: ``torch._scaled_mm``), a backend's way to a faster
    kernel for the same product (``modelpar.backends``); returns the previous one."""
    global _scaled_mm
    previous, _scaled_mm = _scaled_mm, gemm or torch._scaled_mm
    return previous


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The dequantization scale amax / 448 (1 where amax is 0: an all-zero row stays zero)."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t / scale in float8 e4m3 (saturated at +-448); ``scale``: [] or [rows, 1]."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _padded(t: torch.Tensor) -> torch.Tensor:
    rows, cols = (-t.shape[0]) % ALIGN, (-t.shape[1]) % ALIGN
    t = F.pad(t, (0, cols, 0, rows)) if rows or cols else t
    return t.contiguous()


def fp8_matmul(
    a: torch.Tensor,
    a_dims: tuple[str, str],
    b: torch.Tensor,
    b_dims: tuple[str, str],
    scaling: Fp8Scaling,
    out_dtype: torch.dtype,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``a @ b.T`` in FP8: a: [M, K], b: [N, K] (high precision; axes named by ``a_dims``, ``b_dims``, the
    second of each the contraction) -> ([M, N] in ``out_dtype``, a's scale, b's scale). ``scales``: scales
    already known (a tensorwise operand used by two GEMMs), else computed (collective where a group splits)."""
    m, n = a.shape[0], b.shape[0]
    a, b = _padded(a), _padded(b)
    sa = scales[0] if scales[0] is not None else scale_of(scaling.amax(a, a_dims))
    sb = scales[1] if scales[1] is not None else scale_of(scaling.amax(b, b_dims))
    # mat1 row-major [M, K], mat2 column-major [K, N] (the transpose of a row-major [N, K]); rowwise scales
    # [M, 1] and [1, N]
    y = _scaled_mm(
        quantize(a, sa),
        quantize(b, sb).t(),
        scale_a=sa,
        scale_b=sb.reshape(1, -1) if sb.dim() else sb,
        out_dtype=out_dtype,
    )
    if y.shape != (m, n):
        y = y[:m, :n].contiguous()  # a fresh tensor, not a view (a view out of an autograd Function is read-only)
    return y, sa, sb


def fp8_forward(x: torch.Tensor, weight: torch.Tensor, scaling: Fp8Scaling, out_dtype: torch.dtype):
    """y = x @ weight.T (x: [T, in], weight: [out, in]) -> (y, x's scale, weight's scale)."""
    return fp8_matmul(x, (TOKENS, IN), weight, (OUT, IN), scaling, out_dtype)


def fp8_input_grad(grad, weight, scaling: Fp8Scaling, out_dtype: torch.dtype, sw) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = grad @ weight (grad: [T, out]) -> (dx, grad's scale). Under tensorwise scaling (one scale per tensor)
    the forward's weight scale ``sw`` serves again; rowwise scales run along another dimension and are new."""
    whole = scaling.mode == "tensorwise"
    dx, sg, _ = fp8_matmul(
        grad, (TOKENS, OUT), weight.t(), (IN, OUT), scaling, out_dtype, (None, sw if whole else None)
    )
    return dx, sg


def fp8_weight_grad(grad, x, scaling: Fp8Scaling, out_dtype: torch.dtype, sg, sx) -> torch.Tensor:
    """dW = grad.T @ x (grad: [T, out], x: [T, in]) -> [out, in]; ``sg`` (the input gradient's, or None) and
    ``sx`` (the forward's) serve again under tensorwise scaling, as in ``fp8_input_grad``."""
    whole = scaling.mode == "tensorwise"
    scales = (sg if whole else None, sx if whole else None)
    dw, _, _ = fp8_matmul(grad.t(), (OUT, TOKENS), x.t(), (IN, TOKENS), scaling, out_dtype, scales)
    return dw


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _Fp8Linear(torch.autograd.Function):
    """``x @ weight.T`` with the forward and both backward GEMMs in FP8 (module docstring). x: [M, K],
    weight: [N, K] -> [M, N] in the compute dtype. The high-precision x and weight are saved for backward,
    which quantizes each again along the dimension its GEMM contracts."""

    @staticmethod
    def forward(ctx, x, weight, scaling):
        y, sx, sw = fp8_forward(x, weight, scaling, compute_dtype(x))
        ctx.save_for_backward(x, weight, sx, sw)
        ctx.scaling, ctx.tag = scaling, current_tag()
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, sx, sw = ctx.saved_tensors
        g = grad_y
        grad_x = grad_w = sg = None
        with comm_tag(ctx.tag):
            if ctx.needs_input_grad[0]:
                dx, sg = fp8_input_grad(g, weight, ctx.scaling, g.dtype, sw)
                grad_x = dx.to(x.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = fp8_weight_grad(g, x, ctx.scaling, g.dtype, sg, sx).to(weight.dtype)
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scaling: Fp8Scaling) -> torch.Tensor:
    """``x @ weight.T`` with all three GEMMs in FP8 under ``scaling``. x: [..., K], weight: [N, K] -> [..., N]."""
    y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, scaling)
    return y.reshape(*x.shape[:-1], weight.shape[0])


__all__ = ["FP8", "FP8_MAX", "FP8_MODES", "Fp8Scaling", "fp8_linear", "fp8_matmul", "quantize", "scale_of"]
