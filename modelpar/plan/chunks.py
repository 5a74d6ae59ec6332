"""A stage's model chunks as the planner sees them: which layers (and block halves) each chunk holds, split as
the trainer splits them, and how many micro-batches of each chunk a stage holds at once under its schedule
(walked along ``modelpar.pipeline.schedule``'s action list, or in closed form for the search)."""

from __future__ import annotations

import dataclasses
import functools

from modelpar.model.flops import half_block_training_flops, head_training_flops
from modelpar.pipeline.actions import B, F, W
from modelpar.pipeline.partition import Partition, partition_by_cost, partition_explicit
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.schedule import V_SCHEDULES, compute_order
from modelpar.plan.bubble import folded_micro_batches
from modelpar.plan.memo import Bounded
from modelpar.plan.spec import ModelSpec, Strategy


def strategy_partition(model: ModelSpec, strategy: Strategy, seq_len: int) -> Partition:
    """The chunks' layer counts: the strategy's own (``stage_layers``), else the trainer's default split; placed
    on ranks as the schedule places them (``Strategy.placement``: V for zbv and dualpipev)."""
    layout, placement = strategy.layout, strategy.placement
    if strategy.stage_layers:
        split = partition_explicit(list(strategy.stage_layers), model.shape.layers, layout.pp, layout.vpp)
        return dataclasses.replace(split, placement=placement) if placement is not split.placement else split
    return trainer_flops_partition(model.shape, seq_len, layout.pp, layout.vpp, placement)


def trainer_flops_partition(
    shape, seq_len: int, pp: int, vpp: int, placement: Placement = Placement.INTERLEAVED
) -> Partition:
    """``parallel.partition=flops`` exactly as ``modelpar.training.build.build_partition`` cuts and places it."""
    if pp * vpp == 1:
        return Partition(1, 1, (float(shape.layers),))
    moe = shape.moe.enabled
    mlp = tuple(shape.mlp_params(i) for i in range(shape.layers)) if moe else shape.mlp_params(0)
    key = (
        shape.layers,
        shape.attention_params(),
        shape.attention_width,
        shape.attention_score_dims() if shape.mla.enabled else None,
        shape.sliding_window,
        tuple(shape.window_layers),
        shape.mtp_depth,
        shape.hidden,
        mlp,
        shape.vocab_size,
        seq_len,
        pp,
        vpp,
        placement,
    )
    return _flops_partition(key, shape)


def _flops_partition(key: tuple, shape) -> Partition:
    if key not in _PARTITIONS:
        seq_len, pp, vpp, placement = key[-4:]
        halves = [c for i in range(shape.layers) for c in half_block_training_flops(shape, seq_len, i)]
        split = partition_by_cost(halves, pp, vpp, head_cost=head_training_flops(shape), halves=True)
        _PARTITIONS[key] = dataclasses.replace(split, placement=placement)
    return _PARTITIONS[key]


_PARTITIONS: dict[tuple, Partition] = Bounded(1 << 12)


def chunk_pieces(partition: Partition, chunk: int) -> list[tuple[int, tuple[str, ...]]]:
    """The blocks of model chunk ``chunk`` as (layer, halves held)."""
    start, stop = partition.half_range(chunk)
    blocks: dict[int, list[str]] = {}
    for half in range(start, stop):
        blocks.setdefault(half // 2, []).append("attention" if half % 2 == 0 else "mlp")
    return [(layer, tuple(halves)) for layer, halves in blocks.items()]


def chunk_piece_counts(partition: Partition, chunk: int, moe) -> tuple:
    """The pieces of model chunk ``chunk`` counted by kind: (((halves held), is a MoE layer), how many)."""
    key = (partition, chunk, *moe_layers_key(moe))
    if key not in _PIECES:
        counts: dict = {}
        for layer, halves in chunk_pieces(partition, chunk):
            kind = (halves, moe.is_moe_layer(layer))
            counts[kind] = counts.get(kind, 0) + 1
        _PIECES[key] = tuple(counts.items())
    return _PIECES[key]


_PIECES: dict[tuple, tuple] = Bounded(1 << 16)


def moe_layers_key(moe) -> tuple:
    """What of a MoE config decides which layers are MoE layers (a cache key)."""
    return moe.experts, moe.every, tuple(moe.layers or ()), moe.first_k_dense_replace


def a_layer(moe_layer: bool, moe, layers: int) -> int:
    """A layer index of that kind (MoE or dense), for the functions that take one."""
    return next((i for i in range(layers) if moe.is_moe_layer(i) == moe_layer), 0)


def in_flight_estimate(pp: int, m: int, vpp: int, stage: int) -> tuple[int, ...]:
    """Interleaved 1F1B without walking it: the ``min(m*v, 2(p-r-1) + (v-1)p + 1)`` warm-up forwards of stage
    ``r``, which visit the local chunks in turns of ``p`` micro-batches (``modelpar.pipeline.schedule``)."""
    held = min(m * vpp, 2 * (pp - stage - 1) + (vpp - 1) * pp + 1)
    mix = [0] * vpp
    for k in range(held):
        mix[(k // pp) % vpp] += 1
    return tuple(mix)


def in_flight_mixes(schedule: str, pp: int, m: int, vpp: int, stage: int) -> tuple[tuple[int, ...], ...]:
    """The distinct numbers of micro-batches each local chunk holds right after a forward of ``stage``'s
    action list (the candidates for its peak); one chunk per rank: ``((min(m, p - stage),),)`` for 1F1B."""
    if schedule == "1f1b" and vpp == 1:
        return ((min(m, pp - stage),),)
    if schedule == "gpipe" and vpp == 1:
        return ((m,),)
    return _walk(schedule, pp, m, vpp)[stage][0]


def v_in_flight_mixes(schedule: str, pp: int, m: int, stage: int) -> tuple[tuple[int, ...], ...]:
    """``in_flight_mixes`` of a V schedule for the search: past ``m = 4p`` walked at the folded ``m``
    (``modelpar.plan.bubble.folded_micro_batches``), whose steady state holds as many activations (the peak
    is the cap of ``modelpar.pipeline.schedule_v``; how they split between the two chunks may differ by one)."""
    return _walk(schedule, pp, folded_micro_batches(pp, m), 2)[stage][0]


@functools.lru_cache(maxsize=1024)
def _walk(schedule: str, pp: int, m: int, vpp: int) -> tuple[tuple[tuple, bool, tuple], ...]:
    """Per stage: its ``in_flight_mixes``, whether it runs a forward after its first backward, and its
    ``gradient_live_sets``, from one walk of the schedule's compute order."""
    out = []
    for actions in compute_order(schedule, pp, m, vpp):
        frees_at = W if any(a.kind is W for a in actions) else B  # also where weight gradients are made
        held = [0] * vpp
        mixes, backward_seen, forward_after = set(), False, False
        live, live_sets = set(), set()
        for a in actions:
            if a.kind is F:
                held[a.chunk] += 1
                mixes.add(tuple(held))
                forward_after = forward_after or backward_seen
            elif a.kind is B:
                backward_seen = True
            if a.kind is frees_at:
                held[a.chunk] -= 1
                live.add(a.chunk)
                live_sets.add(tuple(sorted(live)))
                if a.micro_batch == m - 1:  # the chunk's last: its gradients reduce-scattered
                    live.discard(a.chunk)
        out.append((tuple(sorted(mixes)), forward_after, tuple(sorted(live_sets))))
    return tuple(out)


def gradient_live_sets(strategy: Strategy, stage: int) -> tuple[tuple[int, ...], ...]:
    """The sets of ``stage``'s local chunks that hold gradients accumulated unsharded at once (ZeRO-2/3 over
    several micro-batches): a chunk's from its first weight-gradient action (B, or W under a split backward)
    through its last micro-batch's, which reduce-scatters them. Interleaved 1F1B at ``m = p`` finishes a chunk's
    backwards before the next one starts, so one chunk's gradients at a time, not the stage's."""
    p, v, m = strategy.layout.pp, strategy.layout.vpp, strategy.micro_batches
    if v == 1:
        return ((0,),)
    if strategy.schedule_name in V_SCHEDULES:
        m = folded_micro_batches(p, m)
    return _walk(strategy.schedule_name, p, m, v)[stage][2]


# -- model states ----------------------------------------------------------------------------------------------


def forward_after_backward(strategy: Strategy, stage: int) -> bool:
    """Whether pipeline stage ``stage`` runs a forward after its first backward: 1F1B (and ZB-H1) after its
    ``p - r`` warm-up forwards (interleaved: ``in_flight_estimate``'s), never under GPipe; the V schedules as
    their action lists say (walked at the folded ``m``)."""
    p, v, m = strategy.layout.pp, strategy.layout.vpp, strategy.micro_batches
    if strategy.schedule_name == "gpipe":
        return False
    if strategy.schedule_name in V_SCHEDULES:
        return _walk(strategy.schedule_name, p, folded_micro_batches(p, m), v)[stage][1]
    return m * v > sum(in_flight_estimate(p, m, v, stage)) if v > 1 else m > p - stage
