"""modelpar_kernels: fused ops, one file per op (Triton kernel, autograd.Function, torch reference).

Each op takes ``backend``: "torch" (plain PyTorch, the CPU default and the ground truth) or "triton".
``resolve_backend("auto", device)`` picks Triton on CUDA and torch elsewhere.
"""

from __future__ import annotations

import torch
from modelpar_kernels.attention import attention_reference
from modelpar_kernels.cross_entropy import vocab_parallel_cross_entropy_reference
from modelpar_kernels.rmsnorm import rms_norm_reference
from modelpar_kernels.rope import apply_rope_reference, rope_tables
from modelpar_kernels.swiglu import swiglu_reference

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(kernels: str, device: torch.device | str) -> str:
    """Map a ``model.kernels`` setting to the backend that runs: auto -> triton on CUDA, torch elsewhere."""
    if kernels not in BACKENDS:
        raise ValueError(f"model.kernels={kernels!r} is not one of {BACKENDS}")
    if kernels == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return kernels


def rms_norm(x, weight, eps, residual=None, *, backend: str = "torch"):
    """See ``rmsnorm.rms_norm_reference`` for shapes."""
    return rms_norm_reference(x, weight, eps, residual)


def apply_rope(x, cos, sin, *, backend: str = "torch"):
    """See ``rope.apply_rope_reference`` for shapes."""
    return apply_rope_reference(x, cos, sin)


def swiglu(gate, up, *, backend: str = "torch"):
    return swiglu_reference(gate, up)


def attention(q, k, v, causal: bool = True, *, backend: str = "torch"):
    """See ``attention.attention_reference`` for shapes."""
    return attention_reference(q, k, v, causal)


def vocab_parallel_cross_entropy(logits, targets, *, backend: str = "torch", **kwargs):
    """See ``cross_entropy.vocab_parallel_cross_entropy_reference``."""
    return vocab_parallel_cross_entropy_reference(logits, targets, **kwargs)


__all__ = [
    "BACKENDS",
    "apply_rope",
    "attention",
    "resolve_backend",
    "rms_norm",
    "rope_tables",
    "swiglu",
    "vocab_parallel_cross_entropy",
]
