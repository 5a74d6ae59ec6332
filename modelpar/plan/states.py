"""The planner's model of a rank's model states under ZeRO 0-3, exact from the parameter shapes.

**Model states** per rank, exact from the parameter shapes of this rank's chunks (``P`` elements; the split
is the trainer's, ``parallel.partition=flops`` unless given). modelpar keeps fp32 parameters whatever
``trainer.dtype`` (bf16 runs autocast over them), fp32 gradients and AdamW's two fp32 moments::

    zero  weights      gradients            optimizer              buffers / gathered (peak)
    0     4P           4P (in the buckets)  8P                     flags 4 * tensors, where dp x cp > 1
    1     4P           4P + 4S (its shard)  8S + 4S (fp32 master)  -                      S = ceil(P / d)
          (under ep: S = ceil(dense / d) + ceil(experts / (d / ep)), the experts sharded over their own group)
    2     4*Q          4*Q                  8*Q                    every weight + a block's gather buffer
    3     4*Q          4*Q                  8*Q                    roots + the block + the next one's buffer
    2, 3  gathered also: the unsharded gradients while micro-batches accumulate (m > 1), 4P at the last one

    Q = sum(ceil(rows/G) * cols) over the tensors (FSDP2's dim-0 shard on rank 0)

with ``d = dp x cp`` and ``G`` the shard group (``optim.zero_group``, else ``d``): FSDP2 shards each tensor along
dim 0, so rank 0 holds ``ceil(rows/G)`` rows. ZeRO-3 gathers a block just before its forward and prefetches
the next into a flat buffer; the chunk's root (embedding, final norm, head) stays gathered from its forward to
its backward (``gathered_bytes``). Gathered weights are fp32 here; bf16 runs gather them in bf16 (not
measured on this machine).
"""

from __future__ import annotations

import math

from modelpar.model.layers.embedding import padded_vocab_size
from modelpar.plan.chunks import (
    a_layer,
    chunk_piece_counts,
    forward_after_backward,
    gradient_live_sets,
    strategy_partition,
)
from modelpar.plan.memo import Bounded
from modelpar.plan.spec import ModelSpec, Strategy


def piece_params(model: ModelSpec, strategy: Strategy, layer: int, half: str) -> list[tuple[int, int]]:
    """(rows, cols) of each parameter tensor of one block half on one rank (its tp shard; experts whole)."""
    shape, layout = model.shape, strategy.layout
    t, h, d = layout.tp, shape.hidden, shape.head_size
    if half == "attention" and shape.mla.enabled:  # the parameters of LatentAttention, in its order
        m, hq = shape.mla, shape.heads // t
        q_rows = m.q_lora_rank or hq * m.qk_head_dim  # q_a_proj (replicated) or q_proj (split over heads)
        down = (q_rows + m.kv_lora_rank + m.qk_rope_head_dim, h)  # fused with kv_a_proj_with_mqa (replicated)
        q = [(m.q_lora_rank, 1), (hq * m.qk_head_dim, m.q_lora_rank)] if m.q_lora_rank else []  # norm, q_b_proj
        kv = [(m.kv_lora_rank, 1), (hq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)]  # norm, kv_b_proj
        return [(h, 1), down, *q, *kv, (h, hq * m.v_head_dim)]
    b = shape.block
    norms = [(h, 1)] * (2 if b.norm == "sandwich" else 1)  # the norm before (or after) the sub-layer; a sandwich's two
    if half == "attention":
        hq, hkv = shape.heads // t, max(1, shape.kv_heads // t)
        qk_norm = [(d, 1), (d, 1)] if shape.qk_norm else []  # q_norm, k_norm
        if shape.qk_norm and b.qk_norm_scope == "projection":  # over all the rank's heads, sharded with them
            qk_norm = [(hq * d, 1), (hkv * d, 1)]
        biases = [((hq + 2 * hkv) * d, 1)] if shape.attention_bias else []  # split with qkv_proj's rows
        biases += [(h, 1)] if shape.attention_out_bias else []  # o_proj's, whole on every rank
        sinks = [(hq, 1)] if b.attention_sinks else []  # one per head, sharded with them
        return [*norms, ((hq + 2 * hkv) * d, h), (h, hq * d), *qk_norm, *biases, *sinks]  # qkv_proj, o_proj
    if not shape.moe.is_moe_layer(layer):
        f = shape.ffn_hidden // t
        return [*norms, (2 * f, h), (h, f)]  # gate_up_proj, down_proj
    moe, fe = shape.moe, shape.expert_ffn_hidden
    local = moe.experts // layout.ep
    out = [*norms, (moe.experts, h), (local, fe * h), (local, fe * h), (local, h * fe)]  # router, w1, w3, w2
    if moe.bias:  # the router's, and each expert's b1, b3, b2 (travelling with their experts)
        out += [(moe.experts, 1), (local * fe, 1), (local * fe, 1), (local * h, 1)]
    if moe.shared_experts:
        fs = moe.shared_experts * fe // t
        out += [(2 * fs, h), (h, fs)]
    return out


def stage_units(model: ModelSpec, strategy: Strategy, seq_len: int, stage: int) -> list[tuple[str, list, int]]:
    """The parameter tensors of a rank of pipeline stage ``stage`` grouped as FSDP2 units: (``block`` or
    ``root``, [(rows, cols) of each tensor], how many such units). Blocks (or half blocks) of a kind, then each
    chunk's root: its embedding, final norm and head (tied embeddings across stages: the last stage's head is
    a copy of the embedding; on the rank holding both ends, the V placement's first, one weight), and the last
    stage's multi-token prediction modules."""
    shape, t, h = model.shape, strategy.layout.tp, model.shape.hidden
    partition = strategy_partition(model, strategy, seq_len)
    vt = padded_vocab_size(shape.vocab_size, t) // t
    units: list[tuple[str, list, int]] = []
    holds_embedding = any(partition.has_embedding(c) for c in partition.chunks_of(stage))
    for c in partition.chunks_of(stage):
        for (halves, moe_layer), count in chunk_piece_counts(partition, c, shape.moe):
            layer = a_layer(moe_layer, shape.moe, shape.layers)
            units.append(("block", [p for half in halves for p in piece_params(model, strategy, layer, half)], count))
        root = [(vt, shape.hidden)] if partition.has_embedding(c) else []
        if partition.has_head(c):
            root.append((shape.hidden, 1))  # final norm
            if not (shape.tie_embeddings and holds_embedding):
                root.append((vt, shape.hidden))  # lm_head, or the tied embedding's copy
            if shape.mtp_depth and not shape.tie_embeddings and not partition.has_embedding(c):
                root.append((vt, shape.hidden))  # multi-token prediction's copy of the embedding
        units.append(("root", root, 1))
        if partition.has_head(c) and shape.mtp_depth:  # each MTP module: 3 norms, eh_proj, a last-layer block
            last = shape.layers - 1
            block = [p for half in ("attention", "mlp") for p in piece_params(model, strategy, last, half)]
            units.append(("block", [(h, 1)] * 3 + [(h, 2 * h), *block], shape.mtp_depth))
    return units


def shard_group_size(strategy: Strategy) -> int:
    """The ranks FSDP2 shards over: ``optim.zero_group`` (hybrid), else all of dp x cp."""
    d = strategy.layout.dp * strategy.layout.cp
    return strategy.zero_group if strategy.zero >= 2 and strategy.zero_group else d


def state_bytes(
    model: ModelSpec, strategy: Strategy, seq_len: int, stage: int, gather_bytes: int = 4
) -> dict[str, float]:
    """Model-state bytes of rank 0 of dp x cp on pipeline stage ``stage`` (the module docstring's table):
    ``weights``, ``gradients``, ``optimizer``, ``buffers`` at the optimizer step, and ``gathered``, FSDP2's
    unsharded weights (``gather_bytes`` per element: the compute dtype's) and gradients at their peak during
    the step (ZeRO-2/3). Remembered per model object for the search, keyed on what they depend on (strategies
    differing only in SP, the cp exchange, the micro-batch size or selective recompute's modules share them)."""
    s = strategy
    key = (s.layout, s.zero, s.zero_group, s.stage_layers, s.schedule_name, s.micro_batches)
    key += (s.reduce_every_micro_batch, s.recompute == "full", seq_len, stage, gather_bytes, s.optimizer)
    held = _STATES.get(id(model))
    if held is None or held[0] is not model:  # the model is held, so its id is not reused while cached
        held = _STATES[id(model)] = (model, Bounded(_PER_MODEL))
    if key not in held[1]:
        held[1][key] = _state_bytes(model, strategy, seq_len, stage, gather_bytes)
    return dict(held[1][key])


_STATES: dict[int, tuple[ModelSpec, dict]] = Bounded(16)  # models
_PER_MODEL = 1 << 16  # answers kept per model


def _state_bytes(model: ModelSpec, strategy: Strategy, seq_len: int, stage: int, gather_bytes: int) -> dict[str, float]:
    units = stage_units(model, strategy, seq_len, stage)
    params = sum(count * r * c for _, tensors, count in units for r, c in tensors)
    d = strategy.layout.dp * strategy.layout.cp
    zero = strategy.zero if d > 1 else 0
    muon = muon_tensors(model, units) if strategy.optimizer == "muon" else set()
    if zero >= 2:
        g = shard_group_size(strategy)
        rows = [
            (count * math.ceil(r / g) * c, (i, j) in muon)
            for i, (_, ts, count) in enumerate(units)
            for j, (r, c) in enumerate(ts)
        ]
        shard = sum(n for n, _ in rows)
        return {
            "weights": 4.0 * shard,
            "gradients": 4.0 * shard,
            "optimizer": 8.0 * shard - 4.0 * sum(n for n, m in rows if m),  # Muon: one buffer, not two moments
            "buffers": 0.0,
            "gathered": gathered_bytes(units, strategy, gather_bytes, stage),
        }
    in_muon = sum(
        count * r * c for i, (_, ts, count) in enumerate(units) for j, (r, c) in enumerate(ts) if (i, j) in muon
    )
    out = {
        "weights": 4.0 * params,
        "gradients": 4.0 * params,
        "optimizer": 8.0 * params - 4.0 * in_muon,
        "buffers": 0.0,
    }
    if zero == 1:
        shard = zero1_shards(model, strategy, seq_len, stage, params)
        out["gradients"] += 4.0 * sum(shard)  # the reduced shard
        # two moments and the fp32 master; Muon's matrices one buffer (segments cut anywhere: pro rata)
        out["optimizer"] = 12.0 * sum(shard) - 4.0 * sum(shard) * in_muon / max(params, 1)
    elif d > 1:  # the gradients live in the all-reduce buckets, beside a has-gradient flag each
        out["buffers"] = 4.0 * zero0_buckets(model, strategy, seq_len, stage)[1]
    out["gathered"] = 0.0
    return out


def muon_tensors(model: ModelSpec, units: list[tuple[str, list, int]]) -> set[tuple[int, int]]:
    """(unit, tensor) positions of ``stage_units`` that ``optim.name=muon`` updates: the blocks' 2-D matrices
    but a MoE router's (the embedding, head and norms are AdamW's; experts stacked, each a matrix)."""
    moe = model.shape.moe
    router = (moe.experts, model.shape.hidden) if moe.enabled else None
    return {
        (i, j)
        for i, (kind, tensors, _) in enumerate(units)
        if kind == "block"
        for j, (r, c) in enumerate(tensors)
        if c > 1 and (r, c) != router
    }


def zero0_buckets(model: ModelSpec, strategy: Strategy, seq_len: int, stage: int) -> tuple[int, int]:
    """(gradient elements, tensors) in zero-0's all-reduce buckets on pipeline stage ``stage`` when dp x cp > 1:
    every parameter's but, at ep = dp x cp, the routed experts' (each rank's own, synced with no one)."""
    units = stage_units(model, strategy, seq_len, stage)
    params = sum(count * r * c for _, tensors, count in units for r, c in tensors)
    tensors = sum(count * len(t) for _, t, count in units)
    if strategy.layout.ep == strategy.layout.dp * strategy.layout.cp:
        experts, expert_tensors = expert_elements(model, strategy, seq_len, stage)
        params, tensors = params - experts, tensors - expert_tensors
    return params, tensors


def zero1_shards(model: ModelSpec, strategy: Strategy, seq_len: int, stage: int, params: int) -> tuple[int, int]:
    """ZeRO-1's shards of this rank's ``params`` elements: (dense, experts). Dense parameters are sharded over
    d = dp x cp; under ep the routed experts, which differ between the ranks of an ep group, form a partition of
    their own sharded over the d / ep ranks holding the same experts (``modelpar.optim.zero``)."""
    d, ep = strategy.layout.dp * strategy.layout.cp, strategy.layout.ep
    experts = expert_elements(model, strategy, seq_len, stage)[0] if ep > 1 else 0
    return math.ceil((params - experts) / d), math.ceil(experts / (d // ep))


def expert_elements(model: ModelSpec, strategy: Strategy, seq_len: int, stage: int) -> tuple[int, int]:
    """(elements, tensors) of the routed experts a rank of pipeline stage ``stage`` holds (w1, w3, w2 of its
    ``E/ep`` experts in each MoE layer, with ``moe.bias`` their b1, b3, b2 too, the multi-token prediction
    blocks' included)."""
    shape, layout = model.shape, strategy.layout
    if not shape.moe.enabled:
        return 0, 0
    local, fe, h = shape.moe.experts // layout.ep, shape.expert_ffn_hidden, shape.hidden
    per_layer = 3 * local * fe * h + (local * (2 * fe + h) if shape.moe.bias else 0)
    tensors = 6 if shape.moe.bias else 3
    partition = strategy_partition(model, strategy, seq_len)
    layers = sum(
        count
        for c in partition.chunks_of(stage)
        for (halves, moe_layer), count in chunk_piece_counts(partition, c, shape.moe)
        if moe_layer and "mlp" in halves
    )
    if shape.mtp_depth and shape.moe.is_moe_layer(shape.layers - 1):  # the MTP blocks on the last stage
        layers += shape.mtp_depth * sum(partition.has_head(c) for c in partition.chunks_of(stage))
    return layers * per_layer, tensors * layers


def chunk_sizes(units: list[tuple[str, list, int]]) -> list[int]:
    """Parameters of each local chunk of ``stage_units`` (each chunk's entries end with its root)."""
    sizes, size = [], 0
    for kind, tensors, count in units:
        size += count * sum(r * c for r, c in tensors)
        if kind != "block":
            sizes.append(size)
            size = 0
    return sizes


def gathered_bytes(
    units: list[tuple[str, list, int]], strategy: Strategy, weight_bytes: int = 4, stage: int = 0
) -> float:
    """FSDP2's unsharded weights and gradients (fp32) at their joint peak on one rank (ZeRO-2/3; ``stage_units``,
    whose chunks each end with their root).

    Besides the parameters it has unsharded, a unit's flat all-gather buffer lives from its (prefetched) gather
    until the copy into them. Weights: stage 2 keeps every weight from the first forward to the reducing backward,
    plus a block's buffer as it is gathered again where each micro-batch frees them; stage 3 in forward the chunk
    roots plus a root's buffer as each forward gathers them again, or the block computing plus the next block's
    buffer (of the same chunk), in backward the roots and the block in backward (full recompute reruns each block
    module: as in forward). Gradients: while micro-batches accumulate (m > 1, not ``reduce_every_micro_batch``),
    each chunk's are held unsharded from its first backward to its last (``gradient_live_sets``: all of the
    stage's at once but for interleaved schedules that finish one chunk before the next), so the peak is the
    forward's gathers where the stage
    runs a forward after its first backward (``forward_after_backward``), else the backward's; with one reduce per
    micro-batch the gradients are the roots' (reduced last) and one block's. Measured on CPU
    (``modelpar.bench.meters.GatheredMeter``);
    GPU streams may hold one more prefetched buffer."""
    params = sum(count * sum(r * c for r, c in tensors) for _, tensors, count in units)
    roots, largest_root, block, pair, chunk = 0, 0, 0, 0, []
    for kind, tensors, count in units:
        size = sum(r * c for r, c in tensors)
        if kind == "block":
            chunk += [size] * min(count, 2)
            continue
        roots, largest_root = roots + size, max(largest_root, size)
        chunk.sort(reverse=True)
        block, pair, chunk = max([block, *chunk[:1]]), max(pair, sum(chunk[:2])), []
    if strategy.zero == 2:
        # every weight from the first forward to the reducing backward; regathered (one block's buffer on top)
        # only where each micro-batch reduces and frees them
        forward = backward = params + (block if strategy.reduce_every_micro_batch or strategy.micro_batches == 1 else 0)
    else:
        forward = roots + max(largest_root, pair)
        backward = forward if strategy.recompute == "full" else roots + block
    if strategy.micro_batches > 1 and not strategy.reduce_every_micro_batch:
        sizes = chunk_sizes(units)
        held = max(sum(sizes[c] for c in live) for live in gradient_live_sets(strategy, stage))
        return 4.0 * held + (forward if forward_after_backward(strategy, stage) else backward) * weight_bytes
    return 4.0 * (roots + block) + forward * weight_bytes
