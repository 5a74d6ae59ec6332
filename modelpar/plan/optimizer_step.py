"""The planner's price of Muon's optimizer step (``Strategy.optimizer == "muon"``; AdamW's is not modelled).

Per step, ``modelpar.optim.muon_layout`` runs Newton-Schulz on every Muon matrix of a pipeline stage once,
spread over the stage's S = tp x dp x cp ranks by FLOPs, and two all-to-alls over the stage in fp32
(``modelpar.optim.muon_exchange``): each rank sends the updates it writes to their matrices' owners, and each
owner sends its results to every rank holding a piece of them::

    ns_s       = NS FLOPs of the stage's matrices / S / rate
    sent       = 4 x (written + owned x holders)
    written    = elements / S               ZeRO-0: each dp x cp replica writes an even stretch of its tp shard;
                                            ZeRO-2/3: its dp shard's rows
               = Muon elements of the rank's ZeRO-1 segment (the stage's parameters end to end, cut evenly)
    owned      = the elements of the matrices the rank owns (largest first, each to the least loaded by FLOPs)
    holders    = dp x cp under ZeRO-0 (each replica gets the results), else 1
    exchange_s = (S - 1) / S x sent / bandwidth(S) + 2 (S - 1) x latency

The matrices are the single-device model's (q, k, v, o, gate, up, down of every layer; each routed expert's
w1, w3, w2; multi-token prediction's projections and blocks not counted), the stage holding layers/pp of them;
the bytes are those of the stage's rank 0, as the planner's model states are.
"""

from __future__ import annotations

from modelpar.model.config import ModelConfig
from modelpar.optim.muon import least_loaded_owners, newton_schulz_flops
from modelpar.plan.links import group_bandwidth
from modelpar.plan.spec import Hardware, ModelSpec, Strategy
from modelpar.plan.states import muon_tensors, stage_units


def layer_matrices(shape: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """The Muon matrices (rows, cols) of one layer of the single-device model."""
    h, d = shape.hidden, shape.head_size
    if shape.mla.enabled:
        m = shape.mla
        q = [(m.q_lora_rank, h), (shape.heads * m.qk_head_dim, m.q_lora_rank)] if m.q_lora_rank else []
        attention = [*(q or [(shape.heads * m.qk_head_dim, h)]), (m.kv_lora_rank + m.qk_rope_head_dim, h)]
        attention += [(shape.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)]
        attention += [(h, shape.heads * m.v_head_dim)]
    else:
        attention = [(shape.heads * d, h), (shape.kv_heads * d, h), (shape.kv_heads * d, h), (h, shape.heads * d)]
    if shape.moe.is_moe_layer(layer):
        fe, moe = shape.expert_ffn_hidden, shape.moe
        mlp = [(fe, h), (fe, h), (h, fe)] * (moe.experts + moe.shared_experts)
    else:
        mlp = [(shape.ffn_hidden, h), (shape.ffn_hidden, h), (h, shape.ffn_hidden)]
    return attention + mlp


def stage_muon(model: ModelSpec, strategy: Strategy, ns_steps: int = 5) -> tuple[int, int]:
    """(Newton-Schulz FLOPs, Muon elements) of the busiest pipeline stage's matrices (layers split evenly)."""
    matrices = stage_matrices(model, strategy)
    return sum(newton_schulz_flops(m, ns_steps) for m in matrices), sum(r * c for r, c in matrices)


def exchange_bytes(model: ModelSpec, strategy: Strategy, seq_len: int | None = None, stage: int = 0) -> float:
    """Bytes rank 0 of a pipeline stage sends in one step's two all-to-alls (the module docstring's ``sent``;
    0: a stage of one): the updates it writes, and its matrices' results to the ranks holding them. The
    owners are the engine's (largest matrices first, each to the least loaded rank by Newton-Schulz FLOPs);
    under ZeRO-1 with ``seq_len`` the Muon elements of rank 0's segment of pipeline stage ``stage`` (its
    parameters end to end, the embedding first, cut into dp x cp even segments), else an even share."""
    layout = strategy.layout
    d = layout.dp * layout.cp
    ranks = layout.tp * d
    if strategy.optimizer != "muon" or ranks == 1:
        return 0.0
    matrices = stage_matrices(model, strategy)
    elements = sum(r * c for r, c in matrices)
    owned = owned_elements(matrices, ranks)[0]
    if strategy.zero == 1 and seq_len is not None:
        written = zero1_muon_share(model, strategy, seq_len, stage)
    else:  # ZeRO-0: each dp x cp replica writes an even stretch of its tp shard; ZeRO-2/3: its dp shard
        written = elements / ranks
    holders = d if strategy.zero == 0 else 1  # ZeRO-0: an owner serves each element to every replica
    return 4.0 * (written + owned * holders)


def stage_matrices(model: ModelSpec, strategy: Strategy) -> list[tuple[int, int]]:
    """The Muon matrices of the busiest pipeline stage (``stage_muon``'s, layers split evenly)."""
    shape, pp = model.shape, strategy.layout.pp
    per_layer = [layer_matrices(shape, layer) for layer in range(shape.layers)]
    flops = [sum(newton_schulz_flops(m, 5) for m in ms) for ms in per_layer]
    stage = -(-shape.layers // pp)
    busiest = max(range(0, shape.layers, stage), key=lambda first: sum(flops[first : first + stage]))
    return [m for ms in per_layer[busiest : busiest + stage] for m in ms]


def owned_elements(matrices: list[tuple[int, int]], ranks: int, ns_steps: int = 5) -> list[int]:
    """Elements each stage rank owns under the engine's rule (``build_muon_layout``): the largest matrices by
    Newton-Schulz FLOPs first, each to the least loaded rank (ties: the lowest)."""
    biggest_first = sorted(matrices, key=lambda m: -newton_schulz_flops(m, ns_steps))
    owned = [0] * ranks
    costs = [newton_schulz_flops(m, ns_steps) for m in biggest_first]
    for (rows, cols), rank in zip(biggest_first, least_loaded_owners(costs, ranks)[0], strict=True):
        owned[rank] += rows * cols
    return owned


def zero1_muon_share(model: ModelSpec, strategy: Strategy, seq_len: int, stage: int) -> int:
    """Muon elements in dp x cp rank 0's ZeRO-1 segment on pipeline stage ``stage``: the stage's parameters
    end to end as the engine lays them (chunk by chunk: the embedding first, the blocks, the root's rest), cut
    into dp x cp even segments. Under ep the routed experts form a partition of their own: an even share."""
    layout = strategy.layout
    if layout.ep > 1:
        return round(sum(r * c for r, c in stage_matrices(model, strategy)) / (layout.tp * layout.dp * layout.cp))
    units = stage_units(model, strategy, seq_len, stage)
    muon = muon_tensors(model, units)
    flat: list[tuple[int, bool]] = []
    chunk_start, first_chunk = 0, True
    for i, (kind, tensors, count) in enumerate(units):
        entries = [(r * c, (i, j) in muon) for j, (r, c) in enumerate(tensors)]
        if kind == "root" and first_chunk and stage == 0 and entries:  # the model's first chunk: its embedding
            flat[chunk_start:chunk_start] = entries[:1]
            entries = entries[1:]
        flat += entries * count
        if kind == "root":
            chunk_start, first_chunk = len(flat), False
    segment = -(-sum(n for n, _ in flat) // (layout.dp * layout.cp))
    share = at = 0
    for n, is_muon in flat:
        share += is_muon * max(0, min(at + n, segment) - at)
        at += n
    return share


def muon_step_s(
    model: ModelSpec, strategy: Strategy, hardware: Hardware, rate: float, seq_len: int | None = None
) -> float:
    """Seconds of Muon's Newton-Schulz and exchange per step on a rank (the module docstring); 0 under AdamW."""
    if strategy.optimizer != "muon":
        return 0.0
    layout = strategy.layout
    flops, _ = stage_muon(model, strategy)
    ranks = layout.tp * layout.dp * layout.cp
    seconds = flops / ranks / rate
    if ranks > 1:
        wire = (ranks - 1) / ranks * exchange_bytes(model, strategy, seq_len)
        seconds += wire / group_bandwidth(hardware, ranks * layout.pp) + 2 * (ranks - 1) * hardware.latency_s
    return seconds


__all__ = ["exchange_bytes", "layer_matrices", "muon_step_s", "stage_muon"]
