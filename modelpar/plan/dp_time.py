"""Data-parallel gradient sync on the critical path (``step_time``'s ``dp_comm_s``): ZeRO-0's all-reduce (the
routed experts' only over the ranks holding the same experts), ZeRO-1's reduce-scatter and gather of the fp32
masters, ZeRO-2/3's per-unit FSDP2 collectives hidden behind the compute they run beside, and the tied
embedding's sync between the first and last pipeline stages."""

from __future__ import annotations

import modelpar.plan.memo as search_memo
from modelpar.pipeline.placement import Placement
from modelpar.plan.links import group_bandwidth, ring_all_gather_s, ring_all_reduce_s
from modelpar.plan.memory import layers_per_chunk, stage_params
from modelpar.plan.spec import GRAD_BYTES, CostModel, Hardware, ModelSpec, Strategy


def routed_expert_params(model: ModelSpec, layout) -> float:
    """The routed experts' parameters on one rank: ``E / ep`` whole experts of each MoE layer it holds."""
    shape = model.shape
    if not shape.moe.enabled:
        return 0.0
    layers = layers_per_chunk(shape.layers, layout) * layout.vpp
    moe_share = sum(shape.moe.is_moe_layer(i) for i in range(shape.layers)) / shape.layers
    return layers * moe_share * shape.moe.experts / layout.ep * 3 * shape.hidden * shape.expert_ffn_hidden


def fsdp_traffic_s(
    model: ModelSpec, strategy: Strategy, hardware: Hardware, params: float, d: int, bw: float
) -> tuple[float, float]:
    """ZeRO-2/3's collectives of one step (seconds, all of them; ``dp_exposed_s`` says which are exposed), and
    one unit's weight gather."""
    layout, m = strategy.layout, strategy.micro_batches
    scatters = m if strategy.reduce_every_micro_batch else 1
    gathers = 2 * m if strategy.zero >= 3 else scatters
    units = layers_per_chunk(model.shape.layers, layout) * layout.vpp + layout.vpp
    latency = units * (d - 1) * hardware.latency_s  # per collective of one unit
    gather = ring_all_gather_s(params * hardware.weight_bytes, d, bw, 0.0) + latency
    moved = scatters * (ring_all_gather_s(params * GRAD_BYTES, d, bw, 0.0) + latency) + gathers * gather
    return moved, gather / units


def dp_exposed_s(
    model: ModelSpec, strategy: Strategy, hardware: Hardware, costs: CostModel, compute_s: float = 0.0
) -> float:
    """Data-parallel gradient sync left on the critical path, plus the tied-embedding sync between stages.
    ``compute_s``: the step's compute on this rank, which ZeRO-2/3's per-unit collectives run beside."""
    layout = strategy.layout
    t, p = layout.tp, layout.pp
    d = layout.dp * layout.cp  # weights are replicated over dp x cp, gradients reduced over both
    params = _end_stage_params(model, layout, strategy.placement)
    bw = group_bandwidth(hardware, layout.world_size)
    exposed = 0.0
    if d > 1 and strategy.zero >= 2:
        # FSDP2 moves each sharded unit (every block, and each chunk's rest) in its own collectives: it
        # reduce-scatters a unit's gradients once, by its last micro-batch's backward (every backward under
        # optim.reduce_every_micro_batch), and all-gathers its weights wherever they were freed: at stage 2 once,
        # from the first forward to the reducing backward (m times when every backward reduces), at stage 3
        # before each forward and each backward. It prefetches: a unit's collectives run while its neighbours
        # compute, so they hide behind the compute of the micro-batches they run in (all of them at stage 3 or
        # when every backward reduces, else the first forward and the last backward: one micro-batch's worth),
        # of which the ``dp_overlap`` share is usable (the streams contend for the device); the first unit's
        # gather has nothing to hide behind.
        # Ranks sharing cores with their collectives' threads (a CPU) hide the dp_overlap share of the traffic.
        moved, first = fsdp_traffic_s(model, strategy, hardware, params, d, bw)
        m = strategy.micro_batches
        window = compute_s if (strategy.zero >= 3 or strategy.reduce_every_micro_batch) else compute_s / m
        if hardware.compute_units:
            exposed = (1 - costs.dp_overlap) * moved
        else:
            exposed = first + max(0.0, moved - first - costs.dp_overlap * window)
    elif d > 1 and strategy.zero1:
        # modelpar's ZeRO-1 reduce-scatters after backward and all-gathers fp32 masters after the step.
        exposed = 2 * ring_all_gather_s(params * GRAD_BYTES, d, bw, hardware.latency_s)
    elif d > 1:
        # the routed experts are replicated over d / ep ranks only (ep splits them over dp x cp): reduced there
        experts = routed_expert_params(model, layout) if layout.ep > 1 else 0.0
        synced = ring_all_reduce_s((params - experts) * GRAD_BYTES, d, bw, hardware.latency_s)
        if experts and d > layout.ep:
            synced += ring_all_reduce_s(experts * GRAD_BYTES, d // layout.ep, bw, hardware.latency_s)
        exposed = (1 - costs.dp_overlap) * synced
    shared = model.tie_embeddings or model.shape.mtp_depth  # the last stage's head or MTP modules embed too
    if p > 1 and shared and strategy.placement is not Placement.V:  # V: one rank, one weight
        embedding = model.shape.vocab_size * model.shape.hidden / t * GRAD_BYTES
        exposed += ring_all_reduce_s(embedding, 2, group_bandwidth(hardware, t * p), hardware.latency_s)
    return exposed


@search_memo.per_search(lambda model, layout, placement: (id(model), layout, placement))
def _end_stage_params(model: ModelSpec, layout, placement: Placement) -> float:
    """The larger of the first and the last stage's parameters (``stage_params``), kept for one search."""
    return max(stage_params(model, layout, st, placement) for st in {0, layout.pp - 1})
