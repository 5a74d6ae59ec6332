"""Model FLOPs, the basis of every MFU figure modelpar prints.

Training FLOPs per token (Kaplan et al. 2020; Chowdhery et al. 2022, appendix B):

    6 * N  +  12 * L * h * s

``N`` counts the parameters that take part in matmuls: every transformer block's attention and MLP weights and
the output head (the embedding lookup is not a matmul and is excluded; a tied head still counts, because the
head matmul runs). ``12 * L * h * s`` is attention's score and value matmuls, forward and backward, at full
(non-causal) cost as the convention counts it. Recomputation is not counted: this is *model* FLOPs. In a
mixture of experts ``N`` counts active parameters only: the router and the top-k routed (plus any shared)
experts a token goes through, never the experts it skips. Multi-token prediction adds, per module, its
projection [h, 2h], its block (of the last layer's kind) and a pass through the shared head to ``N`` and one
more ``12 * h * s`` of attention (``ModelConfig.mtp_params``).
MFU = achieved model FLOP/s / peak FLOP/s.
"""

from __future__ import annotations

from modelpar.model.config import ModelConfig


def training_flops_per_token(shape: ModelConfig, seq_len: int) -> float:
    mtp_head = shape.mtp_depth * shape.vocab_size * shape.hidden  # each module's pass through the shared head
    attention = 12.0 * (shape.layers + shape.mtp_depth) * shape.hidden * seq_len
    return 6.0 * (shape.matmul_params() + mtp_head) + attention


def half_block_training_flops(shape: ModelConfig, seq_len: int, layer: int | None = None) -> tuple[float, float]:
    """Training FLOPs per token of a block's attention half (projections and scores) and of its MLP half (of
    block ``layer``: dense or MoE; None: the mean over the blocks)."""
    return 6.0 * shape.attention_params() + 12.0 * shape.hidden * seq_len, 6.0 * shape.mlp_params(layer)


def head_training_flops(shape: ModelConfig) -> float:
    """Training FLOPs per token of the output head's matmul plus the loss's softmax over the vocabulary (about
    10 element-wise passes forward and backward, costed like matmul FLOPs)."""
    return 6.0 * shape.vocab_size * shape.hidden + 10.0 * shape.vocab_size
