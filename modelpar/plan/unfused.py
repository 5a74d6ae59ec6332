"""The step time of the block-structure pieces no fused kernel computes (``model.block``;
``BlockStructure.unfused``), added to ``modelpar.plan.step_time``'s compute per layer and micro-batch:

- A soft-cap or sinks (``plain_matmul_attention``'s condition, at any cp): the attention core runs in plain
  fp32 matmuls (``modelpar_kernels.attention_math_reference``; block by block under the ring and the
  all-gather). Its score and value matmuls, ``4 * T * hq * d * keys`` FLOPs forward, 2x that backward and once
  more where backward reruns the attention half, run at ``fp32_peak_flops`` (no tensor cores) over every key
  computed (the whole s at cp = 1 or under the all-to-all, the window or causal half notwithstanding; about
  ``s (cp + 1) / 2cp`` under the ring, which skips the blocks above the diagonal), instead of the
  convention's FLOPs at the compute dtype's peak that ``stage_step_flops`` prices. Their element-wise work
  streams fp32 [b, hq/t, s, keys] scores at ``memory_bw``: ``SCORE_PASSES`` passes (scale, mask, softmax
  forward and backward), ``SOFTCAP_PASSES`` more for the cap's divide, tanh and multiply, ``SINK_PASSES`` for
  the sinks' column (a concatenation and its slice).
- A sandwich of norms (``model.block.norm=sandwich``): two more RMSNorms per layer, element-wise work that tp
  repeats on every rank (``SANDWICH_PASSES`` [b, s, h] passes beside ``step_time.REPLICATED_PASSES``; their
  rerun ``SANDWICH_RECOMPUTED_PASSES`` beside ``RECOMPUTED_PASSES``).

GeGLU's tanh-approximated GELU costs a few more element-wise ops than SiLU on a [b, s, f/t] tensor: within the
element-wise passes' error, not priced apart.
"""

from __future__ import annotations

from modelpar.model.flops import attention_keys
from modelpar.plan.saved import plain_matmul_attention
from modelpar.plan.spec import CostModel, Hardware, ModelSpec, Strategy

# each op reads and writes fp32 scores forward (2 accesses) and reads two, writes one backward (3)
SCORE_PASSES = 3 * (2 + 3)  # scale, mask, softmax
SOFTCAP_PASSES = 3 * (2 + 3)  # s / cap, tanh, cap * t
SINK_PASSES = 1 * (2 + 3)  # the sinks' column concatenated, sliced off the probabilities
SANDWICH_PASSES = 18  # two RMSNorms: ~3 passes forward, ~6 backward each
SANDWICH_RECOMPUTED_PASSES = 6


def scores_on_plain_path(model: ModelSpec) -> bool:
    """Whether attention runs in plain matmuls at every cp: a soft-cap or sinks (GQA only)."""
    b = model.shape.block
    return bool(b.attention_softcap or b.attention_sinks) and not model.shape.mla.enabled


def computed_keys(model: ModelSpec, strategy: Strategy, seq_len: int) -> float:
    """Keys per query the plain-matmul core computes scores for (module docstring)."""
    cp = strategy.layout.cp
    if plain_matmul_attention(model, strategy):  # one rank, or the all-to-all: every key of the sequence
        return float(seq_len)
    return seq_len * (cp + 1) / (2 * cp)


def unfused_attention_s(
    model: ModelSpec, strategy: Strategy, hardware: Hardware, seq_len: int, costs: CostModel | None = None
) -> float:
    """Seconds one layer and micro-batch adds on one rank for its plain-matmul attention (0 without a soft-cap
    or sinks): its fp32 matmuls less what ``stage_step_flops`` priced of them, and its score passes."""
    if not scores_on_plain_path(model):
        return 0.0
    costs = costs or CostModel()
    shape, layout = model.shape, strategy.layout
    tokens = strategy.micro_batch_size * seq_len / layout.cp
    heads = shape.heads / layout.tp
    keys = computed_keys(model, strategy, seq_len)
    reruns = _attention_reruns(strategy)
    width = heads * shape.head_size
    fp32_peak = hardware.fp32_peak_flops or hardware.peak_flops
    plain = (3 + reruns) * 4.0 * tokens * width * keys / (fp32_peak * costs.efficiency)
    priced = (
        (3 + reruns) * 4.0 * tokens * width * attention_keys(shape, seq_len) / (hardware.peak_flops * costs.efficiency)
    )
    seconds = max(0.0, plain - priced)
    if hardware.memory_bw:
        b = shape.block
        passes = SCORE_PASSES + SOFTCAP_PASSES * bool(b.attention_softcap) + SINK_PASSES * b.attention_sinks
        seconds += (1 + reruns / 3) * passes * 4.0 * tokens * heads * keys / hardware.memory_bw
    return seconds


def plain_attention_flops(model: ModelSpec, strategy: Strategy, seq_len: int) -> float:
    """FLOPs of one layer's plain-matmul score and value matmuls on one rank and micro-batch, forward, backward
    and any rerun: ``(3 + reruns) * 4 * T * (hq/t) * d * computed_keys``."""
    shape, layout = model.shape, strategy.layout
    tokens = strategy.micro_batch_size * seq_len / layout.cp
    width = shape.heads / layout.tp * shape.head_size
    return (3 + _attention_reruns(strategy)) * 4.0 * tokens * width * computed_keys(model, strategy, seq_len)


def _attention_reruns(strategy: Strategy) -> int:
    """Forwards of the attention core backward reruns: full recompute's, and selective's that names the
    attention half (``elementwise`` caches the matmuls' outputs)."""
    if strategy.recompute == "full":
        return 1
    return int(strategy.recompute == "selective" and "attention" in strategy.recompute_modules)


def sandwich_passes(model: ModelSpec, strategy: Strategy) -> tuple[int, int]:
    """(replicated, recomputed) [b, s, h] element-wise passes a sandwich's two more norms add per layer."""
    if model.block != "llama" or model.shape.block.norm != "sandwich":
        return 0, 0
    selective = strategy.recompute == "selective" and "elementwise" in strategy.recompute_modules
    return SANDWICH_PASSES, SANDWICH_RECOMPUTED_PASSES * selective
