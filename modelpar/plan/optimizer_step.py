"""The planner's price of Muon's optimizer step (``Strategy.optimizer == "muon"``; AdamW's is not modelled).

Per step, ``modelpar.optim.muon_layout`` runs Newton-Schulz on every Muon matrix of a pipeline stage once,
spread over the stage's S = tp x dp x cp ranks by FLOPs, and two all-to-alls over the stage in fp32
(``modelpar.optim.muon_exchange``): each rank sends the updates it writes to their matrices' owners, and each
owner sends its results to every rank holding a piece of them::

    ns_s       = NS FLOPs of the stage's matrices / S / rate
    sent       = 2 x 4 x elements / tp      ZeRO-0: dp x cp rank 0 writes its whole tp shard, and an owner
                                            serves each of its elements to the dp x cp replicas
               = 2 x 4 x elements / S       ZeRO-1/2/3: each element held (and written) once
    exchange_s = (S - 1) / S x sent / bandwidth(S) + 2 (S - 1) x latency

The matrices are the single-device model's (q, k, v, o, gate, up, down of every layer; each routed expert's
w1, w3, w2; multi-token prediction's projections and blocks not counted), the stage holding layers/pp of them.
"""

from __future__ import annotations

from modelpar.model.config import ModelConfig
from modelpar.optim.muon import newton_schulz_flops
from modelpar.plan.links import group_bandwidth
from modelpar.plan.spec import Hardware, ModelSpec, Strategy


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
    shape, pp = model.shape, strategy.layout.pp
    per_layer = [layer_matrices(shape, layer) for layer in range(shape.layers)]
    flops = [sum(newton_schulz_flops(m, ns_steps) for m in ms) for ms in per_layer]
    elements = [sum(r * c for r, c in ms) for ms in per_layer]
    stage = -(-shape.layers // pp)
    busiest = max(range(0, shape.layers, stage), key=lambda first: sum(flops[first : first + stage]))
    return sum(flops[busiest : busiest + stage]), sum(elements[busiest : busiest + stage])


def exchange_bytes(model: ModelSpec, strategy: Strategy) -> float:
    """Bytes a rank sends in one step's two all-to-alls (the module docstring's ``sent``; 0: a stage of one)."""
    layout = strategy.layout
    ranks = layout.tp * layout.dp * layout.cp
    if strategy.optimizer != "muon" or ranks == 1:
        return 0.0
    _, elements = stage_muon(model, strategy)
    return 2 * 4.0 * elements / (layout.tp if strategy.zero == 0 else ranks)


def muon_step_s(model: ModelSpec, strategy: Strategy, hardware: Hardware, rate: float) -> float:
    """Seconds of Muon's Newton-Schulz and exchange per step on a rank (the module docstring); 0 under AdamW."""
    if strategy.optimizer != "muon":
        return 0.0
    layout = strategy.layout
    flops, _ = stage_muon(model, strategy)
    ranks = layout.tp * layout.dp * layout.cp
    seconds = flops / ranks / rate
    if ranks > 1:
        wire = (ranks - 1) / ranks * exchange_bytes(model, strategy)
        seconds += wire / group_bandwidth(hardware, ranks * layout.pp) + 2 * (ranks - 1) * hardware.latency_s
    return seconds


__all__ = ["exchange_bytes", "layer_matrices", "muon_step_s", "stage_muon"]
