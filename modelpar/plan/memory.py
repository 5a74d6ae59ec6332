"""Bytes on one rank of a pipeline stage: our block's exact tables (``modelpar.plan.activations`` for what it
keeps for backward, ``modelpar.plan.states`` for the model states of ZeRO 0-3), or Megatron-LM's GPT block and
engine (``block="gpt"``, the published runs).

The GPT block, mixed precision ``bf16``: 18 bytes per parameter = 2 (bf16 weights) + 4 (fp32 gradients) + 12
(fp32 master weights and the two Adam moments); ZeRO-1 divides the 12 by dp. ``fp32`` (CPU): 16 = 4 + 4 + 8 (no
master copy). Activations per layer per micro-batch (Korthikanti et al. 2022, 16-bit, GPT block; doubled for
fp32)::

    none        s*b*h * (10 + 24/t + 5*a*s/(h*t))        with SP:  s*b*h * (34 + 5*a*s/h) / t
    selective   s*b*h * (10 + 24/t)                      with SP:  s*b*h * 34 / t
    full        2*s*b*h (the layer input only)           with SP:  2*s*b*h / t

times the layers of one model chunk times the chunks in flight on that rank, read off the schedules in
``modelpar.pipeline.schedule``: 1F1B holds ``min(m, p - r)`` micro-batches on stage ``r``; interleaved
warms up with ``2*(p - r - 1) + (v - 1)*p`` chunk forwards and holds one more, which on the first stage is
``L * (1 + (p-1)/(p*v))`` layers' worth (Korthikanti et al. 2022, section 4.2.3). Recompute adds one layer's
transient working set; the last stage adds fp32 logits ``4*s*b*V/t``; the first the embedding's dropout mask.
The busiest chunk's layers are assumed on every stage (an uneven split's memory is not modelled for this block).
``ModelSpec.flash_attention`` drops the stored ``s x s`` scores (what a fused attention kernel does).
"""

from __future__ import annotations

import dataclasses
import math

from modelpar.model.config import ModelConfig
from modelpar.parallel.layout import ParallelLayout
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.schedule import V_SCHEDULES
from modelpar.plan.activations import stage_activations
from modelpar.plan.chunks import chunk_piece_counts, moe_layers_key, strategy_partition, v_in_flight_mixes
from modelpar.plan.memo import Bounded
from modelpar.plan.saved import activation_bytes
from modelpar.plan.spec import GRAD_BYTES, Hardware, MemoryBreakdown, ModelSpec, Strategy
from modelpar.plan.states import state_bytes


def layers_per_chunk(layers: int, layout: ParallelLayout) -> int:
    """Layers in the busiest model chunk (uneven splits give some chunk one more)."""
    return math.ceil(layers / (layout.pp * layout.vpp))


def chunks_in_flight(strategy: Strategy, stage: int) -> int:
    """Model chunks whose activations stage ``stage`` holds at its peak under the strategy's schedule."""
    p, v, m = strategy.layout.pp, strategy.layout.vpp, strategy.micro_batches
    if strategy.schedule_name in V_SCHEDULES:
        return max(sum(mix) for mix in v_in_flight_mixes(strategy.schedule_name, p, m, stage))
    if strategy.schedule_name == "zb-h1":  # each B's activations wait for its W: 1F1B's p on every stage
        return min(m, p)
    if v == 1:
        return min(m, p - stage)
    return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)


def activation_bytes_per_layer(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> float:
    """Stored activations of one layer for one micro-batch (Korthikanti et al. 2022, table 2), on one cp rank."""
    s, b, h, a, t = seq_len, strategy.micro_batch_size, model.shape.hidden, model.shape.heads, strategy.layout.tp
    attention_scores = 0 if model.flash_attention else 5 * a * s / h  # local queries x every key: full s
    if strategy.recompute == "full":
        per_token = 2.0 / (t if strategy.sp else 1)
    elif strategy.sp:
        per_token = (34 + (attention_scores if strategy.recompute == "none" else 0)) / t
    else:
        per_token = 10 + 24 / t + (attention_scores / t if strategy.recompute == "none" else 0)
    return s / strategy.layout.cp * b * h * per_token * (hardware.weight_bytes / 2)


def recompute_working_bytes(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> float:
    """Transient activations rebuilt while one layer's backward runs (nothing without recompute)."""
    if strategy.recompute == "none":
        return 0.0
    full = dataclasses.replace(strategy, recompute="none")
    kept = activation_bytes_per_layer(model, strategy, seq_len, hardware)
    return activation_bytes_per_layer(model, full, seq_len, hardware) - kept


def stage_params(
    model: ModelSpec, layout: ParallelLayout, stage: int, placement: Placement = Placement.INTERLEAVED
) -> float:
    """Parameters stored on a rank of pipeline stage ``stage`` (its tp shard); the embedding and the head where
    ``placement`` puts the first and the last chunk (V: both on stage 0, one weight if tied)."""
    shape, t = model.shape, layout.tp
    norms = 2 * shape.hidden + (2 * shape.head_size if shape.qk_norm else 0)  # replicated over tp
    layer = stored_block_params(shape, layout) + norms
    params = layers_per_chunk(shape.layers, layout) * layout.vpp * layer
    embedding = shape.vocab_size * shape.hidden / t
    first, last = holds_ends(layout, stage, placement)
    if first:
        params += embedding
    if last:
        params += shape.hidden + (0 if first and model.tie_embeddings else embedding)
    return params


def holds_ends(layout: ParallelLayout, stage: int, placement: Placement) -> tuple[bool, bool]:
    """Whether pipeline stage ``stage`` holds the first model chunk (the embedding) and the last (the head)."""
    chunks = layout.pp * layout.vpp
    return placement.locate(0, layout.pp)[0] == stage, placement.locate(chunks - 1, layout.pp)[0] == stage


def stage_label(layout: ParallelLayout, stage: int, placement: Placement) -> str:
    """``first``, ``last``, ``first+last`` (the V placement's rank 0) or ``stage r``."""
    first, last = holds_ends(layout, stage, placement)
    if first and last and layout.pp > 1:
        return "first+last"
    return "first" if first else "last" if last else f"stage {stage}"


def stored_block_params(shape: ModelConfig, layout: ParallelLayout) -> float:
    """Parameters of one block a rank stores, the mean over the blocks: its tp shard of attention and of a
    dense MLP; in a MoE block the router, the shared experts' tp shard and ``E/ep`` whole experts."""
    moe, t = shape.moe, layout.tp
    if not moe.enabled:  # every block alike
        return shape.attention_params() / t + shape.mlp_params(0) / t
    total = 0.0
    for i in range(shape.layers):
        if moe.is_moe_layer(i):
            expert = 3 * shape.hidden * shape.expert_ffn_hidden
            total += shape.hidden * moe.experts + moe.shared_experts * expert / t + moe.experts / layout.ep * expert
        else:
            total += shape.mlp_params(i) / t
    return shape.attention_params() / t + total / shape.layers


def stage_memory(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int, *, exact: bool = True
) -> MemoryBreakdown:
    """Bytes on a rank of pipeline stage ``stage``: our block's exact tables (``activations``, ``states``), or the GPT
    block's Korthikanti et al. terms with Megatron's model states (``model.block == "gpt"``). ``exact=False``:
    interleaved schedules' in-flight chunks in closed form (the search's shortcut)."""
    layout = strategy.layout
    label = stage_label(layout, stage, strategy.placement)
    if model.block == "gpt":
        return _gpt_stage_memory(model, strategy, seq_len, hardware, stage, label)
    states = state_bytes(model, strategy, seq_len, stage, activation_bytes(hardware))
    act = stage_activations(model, strategy, seq_len, hardware, stage, exact=exact)
    host_on_device = act.host if not hardware.host_bw else 0.0  # a CPU: the host copies share its memory
    return MemoryBreakdown(
        stage=label,
        weights=states["weights"],
        grads=states["gradients"],
        optimizer=states["optimizer"],
        activations=act.device + act.working + host_on_device,
        reserved=hardware.reserved_bytes,
        gathered=states["gathered"],
        buffers=states["buffers"],
        saved=act.device,
        working=act.working,
        host=act.host,
    )


def _gpt_stage_memory(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int, label: str
) -> MemoryBreakdown:
    """Megatron-LM's GPT block (the module docstring's Korthikanti et al. terms, 18 or 16 bytes of states)."""
    layout = strategy.layout
    params = stage_params(model, layout, stage, strategy.placement)
    first, last = holds_ends(layout, stage, strategy.placement)
    s, b, h, t = seq_len / layout.cp, strategy.micro_batch_size, model.shape.hidden, layout.tp
    in_flight = chunks_in_flight(strategy, stage)
    per_layer = activation_bytes_per_layer(model, strategy, seq_len, hardware)
    activations = per_layer * layers_per_chunk(model.shape.layers, layout) * in_flight
    working = recompute_working_bytes(model, strategy, seq_len, hardware)
    if first:
        activations += s * b * h * in_flight / (t if strategy.sp else 1)  # embedding dropout mask, 1 byte
    if last:
        activations += 4 * s * b * model.shape.vocab_size / t  # fp32 logits for the cross-entropy
    d = layout.dp * layout.cp
    optimizer = params * hardware.optimizer_bytes / (d if strategy.zero >= 1 else 1)
    grads = params * GRAD_BYTES / (d if strategy.zero >= 2 else 1)
    weights = params * hardware.weight_bytes / (d if strategy.zero >= 3 else 1)
    gathered = 0.0
    if strategy.zero >= 3:  # FSDP2 holds the gathered weights of the block computing and of the one prefetched
        gathered = 2 * (stored_block_params(model.shape, layout) + 2 * h) * hardware.weight_bytes
    return MemoryBreakdown(
        stage=label,
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=activations + working,
        reserved=hardware.reserved_bytes,
        gathered=gathered,
        saved=activations,
        working=working,
    )


def peak_memory(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, *, exact: bool = True
) -> MemoryBreakdown:
    """The fullest pipeline stage. Often the first (most micro-batches in flight) or the last (head and logits),
    but not always: a stage just after the first can hold almost as many micro-batches of more or heavier layers
    (a FLOP-balanced split gives the embedding's stage fewer layers; DeepSeek-V3's first layers are dense and
    light). Every stage that can be the fullest is priced (``candidate_stages``)."""
    return max(_candidate_memories(model, strategy, seq_len, hardware, exact).values(), key=lambda m: m.total)


def fullest_stage(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> int:
    """The index of the stage ``peak_memory`` prices."""
    memories = _candidate_memories(model, strategy, seq_len, hardware, True)
    return max(memories, key=lambda st: memories[st].total)


def _candidate_memories(model, strategy, seq_len, hardware, exact) -> dict[int, MemoryBreakdown]:
    stages = candidate_stages(model, strategy, seq_len)
    return {st: stage_memory(model, strategy, seq_len, hardware, st, exact=exact) for st in stages}


def candidate_stages(model: ModelSpec, strategy: Strategy, seq_len: int) -> tuple[int, ...]:
    """The pipeline stages that can hold the most: the first, the last, and of the others the first of each
    layer composition (the pieces of each of its chunks, by kind). Outside the V placement a stage holds no more
    micro-batches of each chunk in flight than any stage before it, so a later stage made of the same layers is
    never fuller; under the V placement every stage is priced."""
    pp = strategy.layout.pp
    if strategy.placement is Placement.V or pp <= 2:
        return tuple(range(pp))
    partition = strategy_partition(model, strategy, seq_len)
    moe = model.shape.moe
    key = (partition, *moe_layers_key(moe))
    if key not in _CANDIDATES:
        seen: set = set()
        middle = []
        for stage in range(1, pp - 1):
            composition = tuple(chunk_piece_counts(partition, c, moe) for c in partition.chunks_of(stage))
            if composition not in seen:
                seen.add(composition)
                middle.append(stage)
        _CANDIDATES[key] = (0, *middle, pp - 1)
    return _CANDIDATES[key]


_CANDIDATES: dict[tuple, tuple[int, ...]] = Bounded(1 << 12)
