"""What the first and the last stage keep besides their blocks: the embedding's, the head's and loss's, and a
multi-token prediction module's saved activations (symbols as in ``modelpar.plan.saved``)."""

from __future__ import annotations

from modelpar.plan.saved import Dims, Saved


def embedding_saved(x: Dims) -> list[Saved]:
    out = [Saved("embedding: token ids", 8 * x.T), Saved("embedding: foreign-id mask", x.T)]
    return out + [Saved("embedding: its scale sqrt(h), a 0-d tensor", x.e)] * x.embedding_scale


def head_saved(x: Dims, kernels: str) -> list[Saved]:
    e, h, T = x.e, x.h, x.T
    out = [Saved("head: x (RMSNorm)", e * x.Ts * h)]
    if kernels == "torch":
        out.append(Saved("head: x * 1/rms (RMSNorm)", e * x.Ts * h))
    out += [Saved("head: 1/rms (RMSNorm)", 4 * x.Ts), Saved("head: lm_head input", e * x.Tin * h)]
    if x.final_softcap:  # cap * tanh(logits / cap): tanh keeps its output, the logits before the cap's product
        out.append(Saved("head: tanh(logits / cap) (final soft-cap)", e * T * x.vt))
    if kernels == "torch":
        # sum of exp (fp32; under tp a view of the [2, T] buffer all-reduced with the target logits), target
        # index (int64), two masks (bool), the count of valid targets
        stats = (8 if x.tp > 1 else 4) * T + 8 * T + 2 * T + 8
        out += [Saved("loss: exp(logits - max), fp32", 4 * T * x.vt), Saved("loss: per-token statistics", stats)]
    else:
        out.append(Saved("loss: logits (their gradient, in place)", e * T * x.vt))
    return out


def mtp_saved(x: Dims, kernels: str) -> list[Saved]:
    """One multi-token prediction module (``modelpar.model.mtp``) on the last stage, besides its block: the
    embedding of the shifted tokens, ``enorm`` on it, ``hnorm`` on the previous hidden state (whose x the
    norm before a head keeps already), the projection's input [e; h] (2h wide) and, in bf16, its cast weight,
    the head and loss as the main head's, and two fp32 scalars of the loss's mean (count and divisor)."""
    e, h, Ts = x.e, x.h, x.Ts
    torch_kernels = kernels == "torch"
    out = [*embedding_saved(x), Saved("mtp: enorm x", e * Ts * h)]
    for norm in ("enorm", "hnorm"):
        if torch_kernels:
            out.append(Saved(f"mtp: {norm} x * 1/rms", e * Ts * h))
        out.append(Saved(f"mtp: {norm} 1/rms", 4 * Ts))
    out.append(Saved("mtp: eh_proj input [e; h]", e * Ts * 2 * h))
    if e != 4:
        out.append(Saved("mtp: eh_proj weight in the compute dtype", e * 2 * h * h))
    out += head_saved(x, kernels)
    out.append(Saved("mtp: the loss's count and divisor (fp32)", 8))
    return out
