"""Step time of one strategy on the busiest rank: compute, the exposed communication of each parallel
dimension, the pipeline bubble and offload, from the per-rank FLOPs of ``modelpar.model.flops``
(plus recomputed forwards)::

    compute_s  = FLOPs on the busiest rank / (peak * efficiency)
                 + the attention a soft-cap or sinks runs in plain fp32 matmuls, and a sandwich's two more
                 norms (``modelpar.plan.unfused``)
                 + element-wise work tp repeats on every rank (``REPLICATED_PASSES`` [b, s, h] passes per
                 layer, at ``memory_bw``; divided by t with SP) + ``layer_overhead_s`` per layer (host-side
                 dispatch, which no parallelism shrinks); with model.fp8 the projections' FLOPs at the FP8 peak
                 (``fp8_time_factor``: H100/H200 twice bf16)
    tp_comm_s  = per layer per micro-batch 4 collectives of b*s*h elements (and what reruns repeat; under SP
                 with sp_keep_shard one more all-gather per half not rerun, beside the input-gradient matmul of
                 its linear: only what is longer than that matmul, ``kept_shard_exposed_s``),
                 ring cost 2(t-1)/t * bytes / bw (+ latency per ring step); NVLink if t <= gpus_per_node;
                 a MoE layer under SP 2 (its MLP has none), plus one all-reduce a step of the fp32 gradients
                 of the routed experts and the router, which are replicated over tp; and per micro-batch one
                 more for the embedding's output and one for the head's input (one of them on a rank of a
                 pipeline)
    pp_comm_s  = 2 * (v*m + p - 1) p2p transfers of b*s*h/t elements (scatter/gather), not overlapped (the V
                 schedules' turn on the last rank stays local: counted all the same)
    dp_comm_s  = all-reduce 2(d-1)/d * fp32 gradient bytes, exposed fraction (1 - dp_overlap); the routed
                 experts' over the d/ep ranks that hold the same experts (none where ep = d);
                 ZeRO-1: reduce-scatter + all-gather of the fp32 master shards, both exposed; ZeRO-2/3 (FSDP2):
                 per-unit gathers and reduce-scatters, hidden behind dp_overlap of the compute they run beside,
                 the first unit's gather exposed (on a CPU, the flat 1 - dp_overlap share)
    cp_comm_s  = context parallelism, per layer per micro-batch: ring: cp-1 K/V blocks (2*b*(s/cp)*kv*d) forward,
                 as many K/V and cp dK/dV (fp32) blocks backward, each hidden behind one block's attention
                 (4*b*(s/cp)*(s/2cp)*h FLOPs forward, 2.5x that backward) where it is shorter; all-gather: an
                 all-gather of K/V forward, another and a reduce-scatter of dK/dV backward, exposed; all-to-all
                 (Ulysses): q, k, v (kv heads repeated up to a multiple of cp) and the output exchanged forward, their
                 gradients backward, 4 all-to-alls each sending (cp-1)/cp of b*(s/cp)*heads*d, exposed
    ep_comm_s  = mixture of experts, per MoE layer per micro-batch: 4 all-to-alls (6 with full recompute), each
                 rank sending its k*b*(s/cp)/t routed rows of h, all but the 1/ep staying home, not overlapped
    bubble_s   = bubble_ratio * (compute_s + tp_comm_s + cp_comm_s + ep_comm_s): (p-1)/(v*m) for 1F1B and
                 interleaved, the schedule simulator's for zb-h1, zbv and dualpipev (``modelpar.plan.bubble``)
    total_s    = the sum of the above

Expert parallelism (ep, from dp x cp; mixture-of-experts models only): each rank stores ``E/ep`` experts of
every MoE layer, whole (replicated over tp), besides its tp shard of the rest; FLOPs count active experts.
Layouts with ep > 1 are planned at zero-0 only (the trainer runs ZeRO 1-3 with ep, sharding experts over the
expert data-parallel group, which this model does not describe yet); expert gradients are costed like the
dense ones.

Context parallelism (cp) divides every per-token quantity by cp: FLOPs (the balanced causal split gives each
rank equal attention work), activations and their [b, s, h] communication; the attention-score term keeps the
full s (local queries see every earlier key). The all-gather's gathered K/V live only while a layer runs
(backward gathers them again), so they are working memory, not stored activations.
Gradients are reduced (ZeRO-1: sharded) over dp x cp.

Ranks sharing one machine's cores (``compute_units`` > 0, a CPU): with more than one rank, compute_s times
``busy_slowdown`` (cores busy at once share caches and memory bandwidth; measured, not assumed). More ranks
than ``compute_units``: compute_s, tp_comm_s and pp_comm_s also times ranks / units, and the bubble only where
the critical path (compute_s + bubble_s) is longer than that.

The constants are stated in ``Hardware`` (per-device peak, bandwidths, latency) and ``CostModel``
(achievable efficiency, DP overlap); ``tests/plan/test_plan.py`` checks the model against Narayanan et al. 2021.

Left out, so read predictions as +-15%: matmul efficiency falling for small or thin GEMMs (one global factor
instead), TP communication overlapped with compute, the optimizer step, allocator fragmentation, the zero-bubble
schedules' F, B and W not costing one unit each (the bubble assumes they do), DualPipeV's overlap of one
micro-batch's all-to-all with another's compute (the runtime runs the pairs at once; the all-to-alls are priced
exposed), and, for the
GPT block, the memory of an uneven split (the busiest chunk's layers are assumed on every stage).
``ModelSpec.flash_attention`` drops the GPT block's stored ``s x s`` scores (what a
fused attention kernel does). Recompute adds the rerun FLOPs (full: the block's forward; selective: the
attention or MLP halves named, ``elementwise`` ``RECOMPUTED_PASSES`` element-wise passes) and one tp
collective per rerun half; offload adds its copies over ``Hardware.host_bw`` (``offload_per_micro_batch_s``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import modelpar.plan.memo as search_memo
from modelpar.model.config import ModelConfig
from modelpar.model.flops import attention_keys, attention_width, training_flops_per_token
from modelpar.pipeline.partition import partition_by_cost
from modelpar.pipeline.placement import Placement
from modelpar.plan.activations import offloaded_per_micro_batch
from modelpar.plan.bubble import bubble_ratio
from modelpar.plan.dp_time import dp_exposed_s, routed_expert_params
from modelpar.plan.links import group_bandwidth, ring_all_gather_s, ring_all_reduce_s
from modelpar.plan.memory import layers_per_chunk, peak_memory
from modelpar.plan.optimizer_step import muon_step_s
from modelpar.plan.spec import GRAD_BYTES, CostModel, Hardware, ModelSpec, Prediction, Strategy
from modelpar.plan.unfused import sandwich_passes, unfused_attention_s


def _kv_width(model: ModelSpec, tp: int) -> float:
    """K (or V) elements per token on one tp rank: its kv heads (one, replicated, when kv_heads < tp) x d."""
    shape = model.shape
    return max(1.0, shape.kv_heads / tp) * shape.head_size


def cp_exchange_width(model: ModelSpec, tp: int) -> float:
    """Elements per token one tp rank sends in a cp exchange of one layer: its K and V (2 x ``_kv_width``), or
    latent attention's per-token latent ``kv_lora_rank + qk_rope_head_dim`` (the same on every tp rank)."""
    mla = model.shape.mla
    if mla.enabled:
        return float(mla.kv_lora_rank + mla.qk_rope_head_dim)
    return 2 * _kv_width(model, tp)


def rerun_halves(model: ModelSpec, strategy: Strategy) -> tuple[str, ...]:
    """The block halves whose forward backward reruns: both under full recompute; under our selective those
    named in ``recompute_modules``, and with ``elementwise`` the others too (their cheap ops)."""
    if strategy.recompute == "full":
        return ("attention", "mlp")
    if strategy.recompute != "selective" or model.block == "gpt":
        return ()
    modules = set(strategy.recompute_modules)
    return tuple(h for h in ("attention", "mlp") if h in modules or "elementwise" in modules)


def cp_exchange_forwards(model: ModelSpec, strategy: Strategy) -> int:
    """Forward passes of the cp exchange per layer and micro-batch: 2 where backward reruns the attention half's
    forward, except under selective recompute that names only ``elementwise``, which keeps the ring's or the
    all-gather's attention whole (``modelpar.parallel.kept``; not latent attention's, not all-to-all's)."""
    if "attention" not in rerun_halves(model, strategy):
        return 1
    kept = (
        strategy.recompute == "selective"
        and "attention" not in strategy.recompute_modules
        and strategy.cp_comm in ("ring", "allgather")
        and not model.shape.mla.enabled
    )
    return 1 if kept else 2


def rerun_tp_exchanges(model: ModelSpec, strategy: Strategy) -> tuple[int, int]:
    """Tensor-parallel exchanges of [b, s, h] that backward's reruns repeat per layer: (opening, closing). A
    rerun stops at the last tensor its backward needs (torch's checkpoint stops early), so a half's closing
    reduce-scatter (all-reduce without SP) reruns only where the rest of the rerun needs its output: the attention
    half's under full recompute (the MLP's norm reads it); under SP each rerun half's opening all-gather reruns
    (its matmuls read the gathered input), without SP a half opens with no exchange."""
    halves = rerun_halves(model, strategy)
    return (len(halves) if strategy.sp else 0), int(strategy.recompute == "full")


def kept_shard_halves(model: ModelSpec, strategy: Strategy) -> tuple[str, ...]:
    """The block halves whose column-parallel linears keep their input's SP shard and all-gather it again in
    backward (``parallel.sp_keep_shard``): under SP, those backward does not rerun (a rerun half gathers anyway)."""
    if not (strategy.sp and strategy.sp_keep_shard and strategy.layout.tp > 1):
        return ()
    rerun = rerun_halves(model, strategy)
    return tuple(h for h in ("attention", "mlp") if h not in rerun)


def kept_shard_exposed_s(model: ModelSpec, strategy: Strategy, hardware: Hardware, seq_len: int, rate: float) -> float:
    """The exposed time of one micro-batch's all-gathers of kept SP shards on the busiest rank, per layer: each
    runs beside its linear's input-gradient matmul (``modelpar.model.layers.sequence_linear``) and shows only
    where it is longer. The halves of ``kept_shard_halves`` (the MLP's of dense layers: a MoE MLP under SP
    gathers nothing, ``tp_collectives_per_layer``); 0 without SP or with ``sp_keep_shard=false``."""
    halves = kept_shard_halves(model, strategy)
    if not halves:
        return 0.0
    layout, shape = strategy.layout, model.shape
    t = layout.tp
    tokens = strategy.micro_batch_size * seq_len / layout.cp
    nbytes = tokens * shape.hidden * hardware.weight_bytes  # the gathered input, in the compute dtype
    gather = ring_all_gather_s(nbytes, t, group_bandwidth(hardware, t), hardware.latency_s)
    moe_share = sum(map(shape.moe.is_moe_layer, range(shape.layers))) / shape.layers if shape.moe.enabled else 0.0
    m = shape.mla
    if m.enabled:
        qkv = (m.q_lora_rank or shape.heads * m.qk_head_dim) + m.kv_lora_rank + m.qk_rope_head_dim
    else:
        qkv = shape.head_size * (shape.heads + 2 * shape.kv_heads)
    widths = {"attention": (qkv, 1.0), "mlp": (2 * shape.ffn_hidden, 1.0 - moe_share)}
    exposed = 0.0
    for half in halves:
        width, share = widths[half]
        input_grad_s = 2 * tokens * shape.hidden * width / t / rate
        exposed += share * max(0.0, gather - input_grad_s)
    return exposed


def collectives_per_layer(model: ModelSpec, strategy: Strategy) -> float:
    """Tensor-parallel collectives of one layer and micro-batch, in all-reduces of [b, s, h] (under SP an
    all-gather or a reduce-scatter is half of one): 2 forward, 2 backward, and what reruns repeat
    (``rerun_tp_exchanges``); kept SP shards' all-gathers are overlapped (``kept_shard_exposed_s``)."""
    opening, closing = rerun_tp_exchanges(model, strategy)
    return 4 + (0.5 * (opening + closing) if strategy.sp else closing)


def tp_collectives_per_layer(model: ModelSpec, strategy: Strategy, moe_share: float) -> float:
    """``collectives_per_layer``, the mean over the layers: under sequence parallelism a mixture-of-experts MLP
    routes this rank's own tokens to experts replicated over tp, so its half has no tp collective (the experts'
    gradients are summed over tp once a step instead)."""
    count = collectives_per_layer(model, strategy)
    if strategy.sp and moe_share:
        count -= moe_share * (2 + 0.5 * ("mlp" in rerun_halves(model, strategy)))  # and its rerun's all-gather
    return count


def recompute_extra_flops(model: ModelSpec, strategy: Strategy, tokens: float, seq_len: int) -> float:
    """Forward FLOPs one layer runs again in backward: the whole block (full), Megatron's attention core (the GPT
    block's selective), or the attention / MLP halves named in our ``recompute_modules`` (``elementwise``
    reruns no matmul: ``recomputed_elementwise_s``)."""
    shape = model.shape
    if strategy.recompute == "full":
        return layer_forward_flops(shape, tokens, seq_len)
    if strategy.recompute != "selective":
        return 0.0
    if model.block == "gpt":
        return 4.0 * tokens * shape.hidden * attention_keys(shape, seq_len)
    modules, extra = set(strategy.recompute_modules), 0.0
    if "attention" in modules:
        extra += 2.0 * tokens * shape.attention_params() + 4.0 * tokens * attention_width(shape) * attention_keys(
            shape, seq_len
        )
    if "mlp" in modules:
        extra += 2.0 * tokens * shape.mlp_params()
    return extra


def ep_comm_per_layer_s(model: ModelSpec, strategy: Strategy, hardware: Hardware, seq_len: int) -> float:
    """The all-to-alls of one MoE layer and micro-batch (module docstring); 0 without expert parallelism."""
    layout, shape = strategy.layout, model.shape
    ep = layout.ep
    if ep == 1:
        return 0.0
    rows = shape.moe.top_k * strategy.micro_batch_size * seq_len / layout.cp / layout.tp
    sent = rows * shape.hidden * hardware.weight_bytes * (ep - 1) / ep
    bw = group_bandwidth(hardware, layout.tp * layout.cp * layout.pp * ep)  # ep ranks are dp x cp neighbours
    count = 6 if "mlp" in rerun_halves(model, strategy) else 4
    return count * (sent / bw + (ep - 1) * hardware.latency_s)


def layer_forward_flops(shape: ModelConfig, tokens: int, seq_len: int) -> float:
    """One block's forward: matmul weights plus attention's score and value matmuls (as in modelpar.model.flops)."""
    return 2.0 * tokens * shape.block_params() + 4.0 * tokens * attention_width(shape) * attention_keys(shape, seq_len)


# Element-wise passes over a [b, s, h] activation per layer per micro-batch that tensor parallelism does not
# split (sequence parallelism does): two RMSNorms (forward ~3 passes, backward ~6) and two residual adds
# (forward 3, backward ~2), counted in activation-sized reads plus writes.
REPLICATED_PASSES = 24
# What ``elementwise`` selective recompute reruns per layer, in the same [b, s, h] passes: the two RMSNorms
# (~3 each), RoPE on q and k (~4) and SwiGLU's silu and product (~4, over f ~ 2.7h wide, tp-split like it).
RECOMPUTED_PASSES = 14


def replicated_elementwise_s(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> float:
    """One micro-batch's work that every tp rank repeats, on the busiest rank: element-wise passes (0 without
    ``memory_bw``) and the per-layer host overhead (``layer_overhead_s``)."""
    layout = strategy.layout
    layers = layers_per_chunk(model.shape.layers, layout) * layout.vpp
    overhead = layers * hardware.layer_overhead_s
    if not hardware.memory_bw:
        return overhead
    nbytes = strategy.micro_batch_size * seq_len / layout.cp * model.shape.hidden * hardware.weight_bytes
    replicated, rerun = sandwich_passes(model, strategy)  # a sandwich's two more norms
    replicated += REPLICATED_PASSES
    rerun += RECOMPUTED_PASSES if "elementwise" in _selective_modules(model, strategy) else 0
    return overhead + layers * nbytes * (replicated / (layout.tp if strategy.sp else 1) + rerun) / hardware.memory_bw


def _selective_modules(model: ModelSpec, strategy: Strategy) -> tuple[str, ...]:
    return strategy.recompute_modules if strategy.recompute == "selective" and model.block == "llama" else ()


def _step_flops_key(model: ModelSpec, strategy: Strategy, seq_len: int) -> tuple:
    s = strategy  # what the FLOPs read: the chunks, the micro-batch and what recompute reruns
    return id(model), s.layout, s.pipeline, s.micro_batch_size, s.recompute, s.recompute_modules, seq_len


@search_memo.per_search(_step_flops_key)
def stage_step_flops(model: ModelSpec, strategy: Strategy, seq_len: int) -> float:
    """Hardware FLOPs of one micro-batch on the busiest rank (whole tp group), recomputed forwards included.

    The blocks are split as the trainer's default ``parallel.partition=flops`` splits them: the last chunk's
    head counts against half blocks (``partition_by_cost``), so the busiest rank is the costliest chunk set.
    """
    shape, layout = model.shape, strategy.layout
    tokens = strategy.micro_batch_size * seq_len
    forward = layer_forward_flops(shape, tokens, seq_len)
    block = 3 * forward + recompute_extra_flops(model, strategy, tokens, seq_len)
    head = 6.0 * tokens * shape.vocab_size * shape.hidden
    if layout.pp == 1:
        return shape.layers * block + head
    attention_share = (
        2.0 * tokens * shape.attention_params() + 4.0 * tokens * attention_width(shape) * attention_keys(shape, seq_len)
    ) / forward
    return block * _busiest_rank_blocks(
        shape.layers, layout.pp, layout.vpp, round(head / block, 4), round(attention_share, 4), strategy.placement
    )


@functools.lru_cache(maxsize=4096)
def _busiest_rank_blocks(
    layers: int, pp: int, vpp: int, head_in_blocks: float, attention_share: float, placement: Placement
) -> float:
    """Cost of the busiest rank, in blocks, under the trainer's FLOP-balanced split in half blocks (attention
    costs ``attention_share`` of a block, the MLP the rest, the head ``head_in_blocks``), its chunks placed on
    ranks by ``placement``."""
    halves = [attention_share, 1.0 - attention_share] * layers
    split = dataclasses.replace(
        partition_by_cost(halves, pp, vpp, head_cost=head_in_blocks, halves=True), placement=placement
    )

    def cost(chunk: int) -> float:
        start, stop = split.half_range(chunk)
        return sum(halves[start:stop]) + head_in_blocks * split.has_head(chunk)

    return max(sum(cost(c) for c in split.chunks_of(rank)) for rank in range(pp))


def hardware_flops_per_step(model: ModelSpec, strategy: Strategy, seq_len: int) -> float:
    """Model FLOPs of the whole step plus the forwards that recompute runs again."""
    shape, tokens = model.shape, strategy.global_batch * seq_len
    extra = recompute_extra_flops(model, strategy, tokens, seq_len)
    return flops_per_token(shape, seq_len) * tokens + shape.layers * extra


@search_memo.per_search(lambda shape, seq_len: (id(shape), seq_len))
def flops_per_token(shape: ModelConfig, seq_len: int) -> float:
    """``training_flops_per_token``, kept for one search."""
    return training_flops_per_token(shape, seq_len)


@search_memo.per_search(lambda shape: id(shape))
def moe_layer_share(shape: ModelConfig) -> float:
    """The share of the layers that are mixture-of-experts layers (0 for a dense model)."""
    return sum(map(shape.moe.is_moe_layer, range(shape.layers))) / shape.layers if shape.moe.enabled else 0.0


@search_memo.per_search(lambda shape, hardware, seq_len: (id(shape), id(hardware), seq_len))
def fp8_time_factor(shape: ModelConfig, hardware: Hardware, seq_len: int) -> float:
    """Compute time with ``model.fp8`` over the time without: the attention and MLP projections' share ``f`` of
    the training FLOPs runs at ``fp8_peak_flops``, the rest (scores, head) at ``peak_flops``:
    ``1 - f + f * peak / fp8_peak``. 1 with fp8 off or on hardware without FP8 units."""
    if shape.fp8 == "off" or hardware.fp8_peak_flops <= 0:
        return 1.0
    projections = 6.0 * shape.layers * shape.block_params()
    share = projections / flops_per_token(shape, seq_len)
    return 1.0 - share + share * hardware.peak_flops / hardware.fp8_peak_flops


# -- prediction ----------------------------------------------------------------------------------------------


def predict(
    strategy: Strategy, model: ModelSpec, hardware: Hardware, *, seq_len: int, costs: CostModel | None = None
) -> Prediction:
    """Predicted step time and peak memory of ``strategy`` (see the module docstring for every formula)."""
    costs = costs or CostModel()
    layout = strategy.layout
    t, p, v, m = layout.tp, layout.pp, layout.vpp, strategy.micro_batches
    shape, b = model.shape, strategy.micro_batch_size
    rate = hardware.peak_flops * costs.efficiency
    cp = layout.cp
    compute_s = (
        m * stage_step_flops(model, strategy, seq_len) / t / cp / rate * fp8_time_factor(shape, hardware, seq_len)
    )
    compute_s += m * replicated_elementwise_s(model, strategy, seq_len, hardware)
    layers_on_rank = layers_per_chunk(shape.layers, layout) * v
    compute_s += m * layers_on_rank * unfused_attention_s(model, strategy, hardware, seq_len, costs)

    act_bytes = b * seq_len / cp * shape.hidden * hardware.weight_bytes  # one [b, s/cp, h] activation
    tp_bw = group_bandwidth(hardware, t)
    moe_share = moe_layer_share(shape)
    tp_comm_s = m * layers_on_rank * tp_collectives_per_layer(model, strategy, moe_share)
    both_ends = p == 1 or strategy.placement is Placement.V  # one rank holds the embedding and the head
    tp_comm_s += m * (2 if both_ends else 1)  # the vocab-parallel embedding's output and the head's input
    tp_comm_s *= ring_all_reduce_s(act_bytes, t, tp_bw, hardware.latency_s)
    tp_comm_s += m * layers_on_rank * kept_shard_exposed_s(model, strategy, hardware, seq_len, rate)
    if shape.moe.enabled:  # the routed experts and the router are replicated over tp: their gradients summed
        router = layers_on_rank * moe_share * shape.hidden * shape.moe.experts
        replicated = routed_expert_params(model, layout) + router
        tp_comm_s += ring_all_reduce_s(replicated * GRAD_BYTES, t, tp_bw, hardware.latency_s)

    pp_comm_s = 0.0
    if p > 1:
        # Scatter/gather (Narayanan et al. 2021, 4.1): each tp rank sends 1/t of the activation, the receiver
        # all-gathers it over NVLink; with SP the activation is already sharded.
        link = group_bandwidth(hardware, t * p)
        p2p_s = act_bytes / t / link + hardware.latency_s
        if not strategy.sp:
            p2p_s += ring_all_gather_s(act_bytes, t, hardware.intra_node_bw, hardware.latency_s)
        pp_comm_s = 2 * (v * m + p - 1) * p2p_s

    dp_comm_s = dp_exposed_s(model, strategy, hardware, costs, compute_s)
    cp_comm_s = m * layers_on_rank * cp_exposed_per_layer_s(model, strategy, hardware, seq_len, rate)
    ep_comm_s = m * layers_on_rank * moe_share * ep_comm_per_layer_s(model, strategy, hardware, seq_len)
    bubble_s = bubble_ratio(strategy.schedule_name, p, m, v) * (compute_s + tp_comm_s + cp_comm_s + ep_comm_s)
    units = hardware.compute_units
    if units and layout.world_size > 1:
        compute_s *= hardware.busy_slowdown
    if units and layout.world_size > units:
        # more ranks than cores: they time-share, and a rank idle in the bubble hands its core to the others,
        # so the step is the larger of all ranks' compute spread over the cores and the critical path; a
        # message needs both of its ranks running, so communication stretches by the same factor
        share = layout.world_size / units
        shared = compute_s * share
        bubble_s = max(0.0, compute_s + bubble_s - shared)
        compute_s = shared
        tp_comm_s *= share
        pp_comm_s *= share
        cp_comm_s *= share
        ep_comm_s *= share
    memory = peak_memory(model, strategy, seq_len, hardware, exact=False)
    offload_s = m * offload_per_micro_batch_s(model, strategy, seq_len, hardware)
    optimizer_s = muon_step_s(model, strategy, hardware, rate, seq_len)
    total_s = compute_s + tp_comm_s + pp_comm_s + dp_comm_s + cp_comm_s + ep_comm_s + bubble_s + offload_s
    total_s += optimizer_s
    tokens = strategy.global_batch * seq_len
    model_flops = flops_per_token(shape, seq_len) * tokens
    hw_flops = hardware_flops_per_step(model, strategy, seq_len)
    world_peak = layout.world_size * hardware.peak_flops
    return Prediction(
        compute_s=compute_s,
        tp_comm_s=tp_comm_s,
        pp_comm_s=pp_comm_s,
        dp_comm_s=dp_comm_s,
        bubble_s=bubble_s,
        memory=memory,
        fits=memory.total <= hardware.memory_bytes,
        tokens_per_s=tokens / total_s,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        mfu=model_flops / total_s / world_peak,
        hfu=hw_flops / total_s / world_peak,
        cp_comm_s=cp_comm_s,
        ep_comm_s=ep_comm_s,
        offload_s=offload_s,
        optimizer_s=optimizer_s,
    )


def offload_per_micro_batch_s(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> float:
    """Activation offload of one micro-batch on the first stage: every moved byte out to host memory in
    forward and back in backward over ``host_bw``, not overlapped (the copies are queued on the compute
    stream); on a CPU (``host_bw`` 0) one copy at ``memory_bw``."""
    if not strategy.offload or model.block == "gpt":
        return 0.0
    moved = offloaded_per_micro_batch(model, strategy, seq_len, hardware, stage=0)
    if hardware.host_bw:
        return 2 * moved / hardware.host_bw
    return moved / hardware.memory_bw if hardware.memory_bw else 0.0


def cp_exposed_per_layer_s(
    model: ModelSpec, strategy: Strategy, hardware: Hardware, seq_len: int, rate: float
) -> float:
    """Context-parallel K/V exchange of one layer and micro-batch left on the critical path (module docstring)."""
    layout = strategy.layout
    cp, t, b = layout.cp, layout.tp, strategy.micro_batch_size
    if cp == 1:
        return 0.0
    bw = group_bandwidth(hardware, t * cp)  # a cp ring spans tp x cp consecutive ranks
    kv_elements = b * seq_len / cp * cp_exchange_width(model, t)  # this rank's K and V (or latent)
    forwards = cp_exchange_forwards(model, strategy)
    if strategy.cp_comm == "alltoall":  # q/k/v there and the output back, forward; their gradients, backward
        d, kv = model.shape.head_size, max(1, model.shape.kv_heads // t)
        heads = model.shape.heads / t + 2 * kv * cp // math.gcd(kv, cp)  # q, and k, v with kv heads repeated
        qkv = b * seq_len / cp * heads * d * hardware.weight_bytes
        out = b * seq_len / cp * model.shape.heads / t * d * hardware.weight_bytes
        exchange = sum(ring_all_gather_s(nbytes, cp, bw, hardware.latency_s) for nbytes in (qkv, out))
        return (forwards + 1) * exchange
    if strategy.cp_comm == "allgather":  # gathered each forward, again in backward, then dK/dV reduce-scattered
        gather = ring_all_gather_s(kv_elements * cp * hardware.weight_bytes, cp, bw, hardware.latency_s)
        return (forwards + 2) * gather
    send = kv_elements * hardware.weight_bytes / bw + hardware.latency_s
    send_grad = kv_elements * GRAD_BYTES / bw + hardware.latency_s
    block_forward = 4 * b * (seq_len / cp) * (seq_len / (2 * cp)) * attention_width(model.shape) / t / rate
    forward = (cp - 1) * max(0.0, send - block_forward)
    backward = (cp - 1) * max(0.0, send + send_grad - 2.5 * block_forward) + send_grad  # the last dK/dV: home
    return forwards * forward + backward


def cp_bytes_per_layer(model: ModelSpec, strategy: Strategy, hardware: Hardware, seq_len: int) -> float:
    """Bytes one rank sends in the cp exchange of one layer and micro-batch, forward and backward, under the
    strategy's ``cp_comm`` (the terms of ``cp_exposed_per_layer_s``, before any overlap): ring: ``cp - 1`` K/V
    blocks forward, as many K/V and dK/dV (fp32) blocks backward and the last dK/dV home; all-gather: ``(cp-1)/cp``
    of the gathered K/V per gather, dK/dV reduce-scattered; all-to-all: ``(cp-1)/cp`` of q, k, v and the output."""
    layout = strategy.layout
    cp, t, b = layout.cp, layout.tp, strategy.micro_batch_size
    if cp == 1:
        return 0.0
    kv_elements = b * seq_len / cp * cp_exchange_width(model, t)
    forwards = cp_exchange_forwards(model, strategy)
    share = (cp - 1) / cp
    if strategy.cp_comm == "alltoall":
        d, kv = model.shape.head_size, max(1, model.shape.kv_heads // t)
        heads = model.shape.heads / t + 2 * kv * cp // math.gcd(kv, cp)
        out_heads = model.shape.heads / t
        return (forwards + 1) * share * b * seq_len / cp * (heads + out_heads) * d * hardware.weight_bytes
    if strategy.cp_comm == "allgather":
        return (forwards + 2) * share * kv_elements * cp * hardware.weight_bytes
    send, send_grad = kv_elements * hardware.weight_bytes, kv_elements * GRAD_BYTES
    return forwards * (cp - 1) * send + (cp - 1) * (send + send_grad) + send_grad
