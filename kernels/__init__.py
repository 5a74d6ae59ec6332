"""modelpar_kernels: fused ops, one file per op (Triton kernel, autograd.Function, torch reference).

Each op takes ``backend``: "torch" (plain PyTorch, the CPU default and the ground truth), "triton", or "auto"
(resolved from the input's device). ``resolve_backend("auto", device)`` picks Triton on CUDA and torch elsewhere.
"triton" on CPU tensors runs the same kernels in Triton's interpreter (slow; for tests). One block of attention
with its log-sum-exp (what context parallelism merges) has three backends: ``block_attention.py``.
"""

from __future__ import annotations

import torch

# `grid` must come first: it turns on Triton's interpreter for CPU-only torch builds before triton is imported.
from modelpar_kernels import grid  # noqa: F401
from modelpar_kernels.attention import (
    attention_block_backward,
    attention_block_forward,
    attention_math_reference,
    attention_reference,
    attention_triton,
    window_keep,
)
from modelpar_kernels.block_attention import (
    BlockMask,
    accumulation_dtype,
    block_attention_backward,
    block_attention_forward,
)
from modelpar_kernels.cross_entropy import vocab_parallel_cross_entropy_reference, vocab_parallel_cross_entropy_triton
from modelpar_kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from modelpar_kernels.rope import apply_rope_reference, apply_rope_triton, rope_tables
from modelpar_kernels.swiglu import swiglu_reference, swiglu_triton

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(kernels: str, device: torch.device | str) -> str:
    """Map a ``model.kernels`` setting to the backend that runs: auto -> triton on CUDA, torch elsewhere."""
    if kernels not in BACKENDS:
        raise ValueError(f"model.kernels={kernels!r} is not one of {BACKENDS}")
    if kernels == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return kernels


def rms_norm(x, weight, eps, *, backend: str = "torch"):
    """See ``rmsnorm.rms_norm_reference`` for shapes."""
    if resolve_backend(backend, x.device) == "triton":
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def apply_rope(x, cos, sin, *, backend: str = "torch"):
    """See ``rope.apply_rope_reference`` for shapes."""
    if resolve_backend(backend, x.device) == "triton":
        return apply_rope_triton(x, cos, sin)
    return apply_rope_reference(x, cos, sin)


def swiglu(gate, up, *, backend: str = "torch"):
    """gate, up: [..., f] -> silu(gate) * up."""
    if resolve_backend(backend, gate.device) == "triton":
        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)


def attention(
    q,
    k,
    v,
    causal: bool = True,
    *,
    backend: str = "torch",
    documents=None,
    window: int = 0,
    scale=None,
    softcap=0.0,
    sinks=None,
):
    """See ``attention.attention_reference`` for shapes (v's head dim may differ from q's and k's); ``window``
    W > 0: each query sees the W latest positions up to its own; ``documents`` [b, s] (Triton only: the torch
    path of document masking is the engine's); ``scale``: of the scores, 1/sqrt(d) unless given. ``softcap``
    > 0 (scores capped by ``softcap * tanh(s / softcap)``) and ``sinks`` [hq] (a learned logit per head in each
    softmax) run on the plain-matmul torch path whatever the backend (``attention_math_reference``)."""
    if softcap or sinks is not None:
        if documents is not None:
            raise ValueError("attention(softcap=..., sinks=...) takes no documents; the engine masks them")
        keep = window_keep(q.shape[1], k.shape[1], causal, window, device=q.device)
        return attention_math_reference(q, k, v, keep, softcap, sinks, scale)
    if resolve_backend(backend, q.device) == "triton":
        return attention_triton(q, k, v, causal, documents, window, scale)
    if documents is not None:
        raise ValueError("attention(documents=...) runs on the triton backend; the torch reference takes none")
    return attention_reference(q, k, v, causal, window, scale)


def vocab_parallel_cross_entropy(logits, targets, *, backend: str = "torch", **kwargs):
    """See ``cross_entropy.vocab_parallel_cross_entropy_reference`` (``group``, and the optional ``all_reduce``
    run over it, come from the caller: this package never imports an engine).

    With backend "triton" the gradient is written over ``logits`` during forward: the caller's logits buffer is
    consumed and must not be read afterwards.
    """
    if resolve_backend(backend, logits.device) == "triton":
        return vocab_parallel_cross_entropy_triton(logits, targets, **kwargs)
    return vocab_parallel_cross_entropy_reference(logits, targets, **kwargs)


__all__ = [
    "BACKENDS",
    "BlockMask",
    "accumulation_dtype",
    "apply_rope",
    "attention",
    "attention_block_backward",
    "attention_block_forward",
    "block_attention_backward",
    "block_attention_forward",
    "resolve_backend",
    "rms_norm",
    "rope_tables",
    "swiglu",
    "vocab_parallel_cross_entropy",
]
