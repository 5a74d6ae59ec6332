"""The planner's collective bytes of one rank and step, per process group and kind, for the dry run to check.

The planner's time model (``modelpar.plan.step_time.predict``) prices each exchange from a byte count; this module
states those counts per rank of one pipeline stage, with the planner's own split of the layers
(``strategy_partition``) and parameter shapes (``stage_units``, ``zero0_buckets``).
Bytes are the tensor's, as ``modelpar.bench.meta_world`` counts them (all-gather: the gathered output,
reduce-scatter: the input, all-to-all and send: what this rank sends). ``a = b*s/cp*h*e`` is one
micro-batch's activation, ``e`` the compute dtype's bytes, ``m`` micro-batches:

    tp    each block half 2 collective pairs (forward, backward): all-gather + reduce-scatter of a (sequence
          parallel), else all-reduce of a; reruns repeat each rerun half's all-gather (SP) and, under full
          recompute, the attention half's closing one (``rerun_tp_exchanges``); under SP with sp_keep_shard one
          more all-gather per half not rerun and per head (``kept_shard_halves``); a MoE MLP under SP none; the fp32
          gradients tp leaves partial (routed experts, router, the norms under SP) all-reduced once; the
          embedding's output and the head's input one pair each           (``tp_collectives_per_layer``)
    pp    a forward's activation a/t (sp) or a to the next stage, a backward's gradient to the previous one
    dp    zero-0: the gradient buckets all-reduced once (4 bytes a value and a flag a tensor; under ep the
          routed experts' over the expert_dp group of d / ep ranks, not at all when ep = dp x cp); zero-1:
          reduce-scatter of the fp32 gradients and all-gather of the fp32 master shards (padded to d shards;
          under ep the experts' over the expert_dp group); zero-2/3: FSDP2's reduce-scatter of each unit's
          padded gradient (``optim.reduce_dtype``) once a step (m times with reduce_every_micro_batch),
          all-gather of its weights in the compute dtype once a step at zero-2, before each forward and
          backward at zero-3
    cp    ring: per layer and micro-batch, each forward's K/V block to the next rank cp-1 times, backward the
          K/V again cp-1 times and dK/dV (fp32) cp times (``cp_exposed_per_layer_s``)
    ep    per MoE layer and micro-batch 4 all-to-alls (6 rerunning the MLP) of k*b*(s/cp)/t rows of h
          (``ep_comm_per_layer_s``)
    muon  (``optim.name=muon``) two all-to-alls over the stage's tp x dp x cp ranks (``exchange_bytes``): the
          world's when pp=1, else the stage group's

Left out, as the time model leaves them out: the embedding's and head's own tp exchanges, the loss's and
routing statistics' small all-reduces, the has-gradient flags of ZeRO-1, FSDP2's gathers at zero-3 of each
chunk's root. The tied embedding's sync (first and last stage; an untied one too when the last stage's MTP modules
embed) is the time model's: its fp32 gradient.
"""

from __future__ import annotations

import math
from collections import defaultdict

from modelpar.model.layers.embedding import padded_vocab_size
from modelpar.plan.chunks import chunk_piece_counts, strategy_partition
from modelpar.plan.optimizer_step import exchange_bytes
from modelpar.plan.saved import activation_bytes
from modelpar.plan.spec import GRAD_BYTES, Hardware, ModelSpec, Strategy
from modelpar.plan.states import expert_elements, shard_group_size, stage_units, zero0_buckets, zero1_shards
from modelpar.plan.step_time import (
    cp_exchange_forwards,
    cp_exchange_width,
    kept_shard_halves,
    rerun_halves,
    rerun_tp_exchanges,
)


def planned_traffic(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int) -> dict:
    """ "group kind" -> bytes this rank of pipeline stage ``stage`` sends in one step (module docstring)."""
    layout, shape = strategy.layout, model.shape
    t, cp, m, b = layout.tp, layout.cp, strategy.micro_batches, strategy.micro_batch_size
    e = activation_bytes(hardware)
    act = b * seq_len / cp * shape.hidden * e
    partition = strategy_partition(model, strategy, seq_len)
    rerun = set(rerun_halves(model, strategy))
    out: dict[str, float] = defaultdict(float)
    halves = {"attention": 0, "mlp": 0}
    moe_layers = whole = 0
    for c in partition.chunks_of(stage):
        for (held, moe_layer), count in chunk_piece_counts(partition, c, shape.moe):
            for half in held:
                halves[half] += count
            whole += count * (len(held) == 2)
            moe_layers += count * (moe_layer and "mlp" in held)
        if shape.mtp_depth and partition.has_head(c):  # the MTP blocks, of the last layer's kind, beside the head
            halves = {half: n + shape.mtp_depth for half, n in halves.items()}
            moe_layers += shape.mtp_depth * shape.moe.is_moe_layer(shape.layers - 1)
    if t > 1:
        tp_halves = dict(halves, mlp=halves["mlp"] - moe_layers * strategy.sp)  # tp_collectives_per_layer
        chunks = partition.chunks_of(stage)
        pairs = 2 * sum(tp_halves.values())
        pairs += sum(partition.has_embedding(c) + partition.has_head(c) for c in chunks)  # embedding out, head in
        opening, closing = rerun_tp_exchanges(model, strategy)  # per layer; the closing one where both halves are
        gathers = pairs + (sum(n for h, n in tp_halves.items() if h in rerun) if opening else 0)
        kept = set(kept_shard_halves(model, strategy))  # each kept shard all-gathered again in backward
        gathers += sum(n for h, n in tp_halves.items() if h in kept)
        gathers += sum(partition.has_head(c) for c in chunks) * (strategy.sp and strategy.sp_keep_shard)
        scatters = pairs + closing * whole
        # the gradients tp leaves partial, summed over tp once (``reduce_tensor_parallel_grads``): the routed
        # experts' (their biases too) and the router's (each tp rank routes its own tokens) and, under SP, the
        # norms' and o_proj's bias (added after the reduce-scatter, to this rank's tokens)
        experts = expert_elements(model, strategy, seq_len, stage)[0]
        partial = experts + moe_layers * shape.moe.experts * shape.hidden
        if shape.moe.bias:  # the router's bias, beside its weight
            partial += moe_layers * shape.moe.experts
        per_head = shape.qk_norm and shape.block.qk_norm_scope == "head"  # each rank sees its heads: partial
        partial += halves["attention"] * 2 * shape.head_size * per_head
        if strategy.sp:
            norms = 2 if shape.block.norm == "sandwich" else 1  # a sandwich's second norm after each sub-layer
            ends = sum(partition.has_head(c) for c in chunks)  # the final norm
            partial += (norms * (halves["attention"] + halves["mlp"]) + ends) * shape.hidden
            partial += halves["attention"] * shape.hidden * shape.attention_out_bias
        out["tp all_reduce"] += GRAD_BYTES * partial
        if shape.qk_norm and shape.block.qk_norm_scope == "projection":  # q's and k's sum of squares, [T] fp32,
            forwards = 1 + ("attention" in rerun)  # forward (and rerun) and backward: OLMo 2's whole-projection norm
            out["tp all_reduce"] += m * halves["attention"] * 2 * (forwards + 1) * 4 * b * seq_len / cp
        if strategy.sp:
            out["tp all_gather"] += m * gathers * act
            out["tp reduce_scatter"] += m * scatters * act
        else:
            out["tp all_reduce"] += m * scatters * act
    if layout.pp > 1:
        p2p = act / t if strategy.sp else act
        last, first = layout.pp * layout.vpp - 1, 0
        for c in partition.chunks_of(stage):
            out["pp send"] += m * p2p * ((c != last) + (c != first))
            out["pp recv"] += m * p2p * ((c != last) + (c != first))
    if cp > 1 and halves["attention"]:
        kv = b * seq_len / cp * cp_exchange_width(model, t)
        forwards = cp_exchange_forwards(model, strategy)
        per_layer = (forwards + 1) * (cp - 1) * kv * e + cp * kv * GRAD_BYTES
        out["cp send"] += m * halves["attention"] * per_layer
        out["cp recv"] += m * halves["attention"] * per_layer
    if layout.ep > 1 and moe_layers:
        rows = shape.moe.top_k * b * seq_len / cp / t
        count = 6 if "mlp" in rerun else 4
        out["ep all_to_all"] += m * moe_layers * count * rows * shape.hidden * e
    shared = model.tie_embeddings or shape.mtp_depth  # the last stage's head or MTP modules use the embedding
    if shared and layout.pp > 1 and stage in (0, layout.pp - 1):  # ``dp_exposed_s``'s tied sync
        vt = padded_vocab_size(shape.vocab_size, t) // t
        out["embedding all_reduce"] += GRAD_BYTES * vt * shape.hidden
    if strategy.optimizer == "muon" and t * layout.dp * cp > 1:
        out[f"{stage_group_name(strategy)} all_to_all"] += exchange_bytes(model, strategy, seq_len, stage)
    _data_parallel(model, strategy, seq_len, stage, e, out)
    return dict(out)


def stage_group_name(strategy: Strategy) -> str:
    """The dry run's name for a stage's tp x dp x cp group (``meta_world.group_names``): the world when pp=1."""
    return "world" if strategy.layout.pp == 1 else "stage"


def _data_parallel(model: ModelSpec, strategy: Strategy, seq_len: int, stage: int, e: int, out: dict) -> None:
    layout = strategy.layout
    d = layout.dp * layout.cp
    if d == 1:
        return
    group = "dp" if layout.cp == 1 else "dp_cp"
    units = stage_units(model, strategy, seq_len, stage)
    if strategy.zero == 0:  # the routed experts' gradients over the ranks holding the same experts (d / ep)
        elements, tensors = zero0_buckets(model, strategy, seq_len, stage)  # a gradient and a flag per tensor
        # (at ep = d the buckets already leave each rank's own experts out, and nothing syncs them; their
        # buckets hold a flag a tensor too)
        experts = GRAD_BYTES * sum(expert_elements(model, strategy, seq_len, stage)) if 1 < layout.ep < d else 0
        out[f"{group} all_reduce"] += GRAD_BYTES * (elements + tensors) - experts
        if experts:
            out["expert_dp all_reduce"] += experts
        return
    params = sum(count * r * c for _, tensors, count in units for r, c in tensors)
    if strategy.zero == 1:  # dense over dp x cp, the experts over the ranks holding the same ones
        dense, experts = zero1_shards(model, strategy, seq_len, stage, params)
        out[f"{group} reduce_scatter"] += GRAD_BYTES * dense * d
        out[f"{group} all_gather"] += GRAD_BYTES * dense * d
        e_dp = d // layout.ep
        if experts and e_dp > 1:
            out["expert_dp reduce_scatter"] += GRAD_BYTES * experts * e_dp
            out["expert_dp all_gather"] += GRAD_BYTES * experts * e_dp
        return
    g = shard_group_size(strategy)
    padded = sum(count * math.ceil(r / g) * g * c for _, tensors, count in units for r, c in tensors)
    m = strategy.micro_batches
    scatters = m if strategy.reduce_every_micro_batch else 1
    out[f"{group} reduce_scatter"] += scatters * padded * GRAD_BYTES
    gathers = 1 if strategy.zero == 2 else 2 * m
    out[f"{group} all_gather"] += gathers * padded * e
