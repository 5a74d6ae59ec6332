"""Model FLOPs, the basis of every MFU figure modelpar prints.

Training FLOPs per token (Kaplan et al. 2020; Chowdhery et al. 2022, appendix B):

    6 * N  +  12 * L * a * s

``N`` counts the parameters that take part in matmuls: every transformer block's attention and MLP weights and
the output head (the embedding lookup is not a matmul and is excluded; a tied head still counts, because the
head matmul runs). ``12 * L * a * s`` is attention's score and value matmuls, forward and backward, at full
(non-causal) cost as the convention counts it, over ``a = heads * head_dim`` (the hidden size h unless
``model.head_dim`` sets another width); with latent attention (qk head dim dk, v head dim dv per head) ``a`` is
``heads * (dk + dv) / 2`` (``attention_width``), the widths the score and value matmuls run at.
Recomputation is not counted: this is *model* FLOPs. In a
mixture of experts ``N`` counts active parameters only: the router and the top-k routed (plus any shared)
experts a token goes through, never the experts it skips.
A sliding-window layer (window W < s) counts only the pairs it attends, at the same doubling: the convention's
``s`` keys per token is twice the causal pairs per token ((s+1)/2 ~ s/2), and a window attends
``W - W(W-1)/(2s)`` per token, so it is counted at ``2W - W(W-1)/s`` keys (``attention_keys``).
Multi-token prediction adds, per module, its projection [h, 2h], its block (of the last layer's kind) and a
pass through the shared head to ``N`` and one more block's attention (``ModelConfig.mtp_params``).
MFU = achieved model FLOP/s / peak FLOP/s.
"""

from __future__ import annotations

from modelpar.model.config import ModelConfig


def attention_width(shape: ModelConfig) -> float:
    """The ``a`` of attention's ``12 * a * s``: heads x head dim for GQA (``hidden`` unless ``model.head_dim``),
    ``heads * (dk + dv) / 2`` for latent attention, whose score (q.k) and value (p.v) matmuls run at different
    head dims."""
    if not shape.mla.enabled:
        return shape.attention_width
    dk, dv = shape.attention_score_dims()
    return shape.heads * (dk + dv) / 2


def attention_keys(shape: ModelConfig, seq_len: int, layer: int | None = None) -> float:
    """Keys per token the FLOP convention counts for block ``layer`` (None: the mean over the blocks): ``seq_len``,
    or under a window W < seq_len ``2W - W(W-1)/seq_len`` (twice the pairs it attends per token)."""
    if layer is None:
        if not shape.sliding_window:
            return float(seq_len)
        return sum(attention_keys(shape, seq_len, i) for i in range(shape.layers)) / shape.layers
    w = shape.window(layer)
    if not w or w >= seq_len:
        return float(seq_len)
    return 2.0 * w - w * (w - 1) / seq_len


def training_flops_per_token(shape: ModelConfig, seq_len: int) -> float:
    mtp_head = shape.mtp_depth * shape.vocab_size * shape.hidden  # each module's pass through the shared head
    attention = 12.0 * (shape.layers + shape.mtp_depth) * attention_width(shape) * attention_keys(shape, seq_len)
    return 6.0 * (shape.matmul_params() + mtp_head) + attention


def half_block_training_flops(shape: ModelConfig, seq_len: int, layer: int | None = None) -> tuple[float, float]:
    """Training FLOPs per token of a block's attention half (projections and scores) and of its MLP half (of
    block ``layer``: dense or MoE; None: the mean over the blocks)."""
    scores = 12.0 * attention_width(shape) * attention_keys(shape, seq_len, layer)
    return 6.0 * shape.attention_params() + scores, 6.0 * shape.mlp_params(layer)


def head_training_flops(shape: ModelConfig) -> float:
    """Training FLOPs per token of the output head's matmul plus the loss's softmax over the vocabulary (about
    10 element-wise passes forward and backward, costed like matmul FLOPs)."""
    return 6.0 * shape.vocab_size * shape.hidden + 10.0 * shape.vocab_size
