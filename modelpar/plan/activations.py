"""The planner's model of one rank's saved activations over the schedule: a chunk's bytes per micro-batch,
summed over the (micro-batch, chunk) pairs a stage holds in flight. What each piece keeps, tensor by tensor,
is ``modelpar.plan.saved``; ``modelpar-bench`` measures the same quantities (``modelpar.bench.meters``) and
``tests/plan/test_plan_memory.py`` holds them within 10% of each other.

A stage holds the sum over the (micro-batch, chunk) pairs in flight, walked along the schedule's own action
list (``modelpar.pipeline.schedule``): a forward adds its chunk's bytes, its backward (a zero-bubble weight
pass, where the schedule has one) frees them. With one chunk per rank this is 1F1B's ``min(m, p - r)``; the V
schedules (zbv, dualpipev) hold two chunks per rank, the first rank's being the first (with the embedding) and
the last (with the head and its logits).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import modelpar.plan.memo as search_memo
from modelpar.pipeline.partition import Partition
from modelpar.pipeline.schedule import V_SCHEDULES
from modelpar.plan.chunks import (
    a_layer,
    chunk_piece_counts,
    in_flight_estimate,
    in_flight_mixes,
    strategy_partition,
    v_in_flight_mixes,
)
from modelpar.plan.saved import (
    Dims,
    Saved,
    attention_saved,
    dims,
    kernels,
    mlp_saved,
    moe_saved,
    plain_matmul_attention,
    sac_saved,
)
from modelpar.plan.saved_ends import embedding_saved, head_saved, mtp_saved
from modelpar.plan.spec import Hardware, ModelSpec, Strategy

OFFLOAD_MIN_BYTES = 16 * 1024  # modelpar.model.activations.ActivationOffload's default


@dataclass(frozen=True)
class StageActivations:
    """Peak saved bytes of one stage: on the device, in host memory (offload), the rerun working set."""

    device: float
    host: float
    working: float


# -- a chunk, a stage ------------------------------------------------------------------------------------------


def half_saved(model: ModelSpec, strategy: Strategy, x: Dims, kern: str, half: str, layer: int) -> list[Saved]:
    """One half of block ``layer`` under the strategy's selective recompute (or none)."""
    modules = set(strategy.recompute_modules) if strategy.recompute == "selective" else set()
    if half in modules:
        return [Saved(f"{half}: input (checkpoint)", x.e * x.Ts * x.h)]
    if "elementwise" in modules:
        moe = model.shape.moe
        return sac_saved(x, half, moe if half == "mlp" and moe.is_moe_layer(layer) else None, kern)
    if half == "attention":
        return attention_saved(x, kern)
    if model.shape.moe.is_moe_layer(layer):
        return moe_saved(model, x, kern, strategy.layout.tp, strategy.layout.ep)
    return mlp_saved(x, kern)


def full_saved(model: ModelSpec, strategy: Strategy, x: Dims, kern: str, half: str, layer: int) -> list[Saved]:
    """A half's tensors with nothing recomputed: what a rerun of it holds while its backward runs (its
    column-parallel inputs gathered: a rerun half keeps no shard, ``Block``)."""
    x = dataclasses.replace(x, Tin=x.T)
    if half == "attention":
        return attention_saved(x, kern)
    if model.shape.moe.is_moe_layer(layer):
        return moe_saved(model, x, kern, strategy.layout.tp, strategy.layout.ep)
    return mlp_saved(x, kern)


_PIECE_BYTES: dict[tuple, tuple[float, float, float]] = search_memo.Bounded(1 << 16)  # by everything it reads


def piece_bytes(
    model: ModelSpec, strategy: Strategy, x: Dims, kern: str, layer: int, halves: tuple[str, ...]
) -> tuple[float, float, float]:
    """(device bytes, host bytes under offload, rerun working set) of one block (or half block) of a chunk."""
    if strategy.recompute == "full":
        kept = [Saved("block: input (checkpoint)", x.e * x.Ts * x.h)]
        working = sum(s.nbytes for half in halves for s in full_saved(model, strategy, x, kern, half, layer))
    else:
        kept, working = [], 0.0
        for half in halves:
            mine = half_saved(model, strategy, x, kern, half, layer)
            kept += mine
            modules = strategy.recompute_modules
            if strategy.recompute == "selective" and (half in modules or "elementwise" in modules):
                rerun = sum(s.nbytes for s in full_saved(model, strategy, x, kern, half, layer))
                working = max(working, rerun - sum(s.nbytes for s in mine))
    device, host = _split_offload(kept, strategy.offload)
    return device, host, working


def chunk_bytes(
    model: ModelSpec,
    strategy: Strategy,
    seq_len: int,
    hardware: Hardware,
    partition: Partition,
    chunk: int,
    memo: dict | None = None,
    x_kern: tuple[Dims, str] | None = None,
) -> tuple[float, float, float]:
    """One micro-batch of model chunk ``chunk``: (device bytes, host bytes, the rerun working set of its largest
    recomputed piece). ``memo`` shares equal pieces' sums between calls of one stage, ``x_kern`` the stage's
    ``dims`` and ``kernels`` (the same for each of its chunks)."""
    memo = {} if memo is None else memo
    x, kern = x_kern or (dims(model, strategy, seq_len, hardware), kernels(model, hardware))
    device = host = working = 0.0
    moe, layers = model.shape.moe, model.shape.layers
    rc = (strategy.recompute, strategy.recompute_modules, strategy.offload)
    for kind, count in chunk_piece_counts(partition, chunk, moe):
        experts = (moe.experts, moe.top_k, moe.shared_experts, model.shape.expert_ffn_hidden, strategy.layout.ep)
        key = (x, kern, rc, kind, experts * kind[1])  # a MoE piece's bytes read ep too (moe_saved)
        if key not in memo:
            if key not in _PIECE_BYTES:
                _PIECE_BYTES[key] = piece_bytes(model, strategy, x, kern, a_layer(kind[1], moe, layers), kind[0])
            memo[key] = _PIECE_BYTES[key]
        d, h, w = memo[key]
        device, host, working = device + count * d, host + count * h, max(working, w)
    d, h = _split_offload(window_masks(model, strategy, seq_len, kern, partition, chunk), strategy.offload)
    device, host = device + d, host + h
    if partition.has_embedding(chunk):
        device += sum(s.nbytes for s in embedding_saved(x))
    if partition.has_head(chunk):
        device += sum(s.nbytes for s in head_saved(x, kern))
        if model.shape.mtp_depth:
            d, h, w = _mtp_bytes(model, strategy, x, kern)
            device, host, working = device + d, host + h, max(working, w)
    return device, host, working


def _mtp_bytes(model: ModelSpec, strategy: Strategy, x: Dims, kern: str) -> tuple[float, float, float]:
    """The last chunk's ``mtp_depth`` multi-token prediction modules: each its own tensors and a block of the
    last layer's kind, under the blocks' selective recompute; full recompute checkpoints the main blocks
    only, so there an MTP block keeps everything."""
    if strategy.recompute == "full":
        strategy = dataclasses.replace(strategy, recompute="none", recompute_modules=())
    device, host, working = piece_bytes(model, strategy, x, kern, model.shape.layers - 1, ("attention", "mlp"))
    own = sum(s.nbytes for s in mtp_saved(x, kern))
    depth = model.shape.mtp_depth
    return depth * (device + own), depth * host, working


def window_masks(
    model: ModelSpec, strategy: Strategy, seq_len: int, kern: str, partition: Partition, chunk: int
) -> list[Saved]:
    """The [s, s] boolean mask the torch path's sliding-window attention hands SDPA, which keeps it: one per
    micro-batch and windowed layer of the chunk whose attention half it holds and does not rerun (cp = 1; the
    Triton kernel and the cp exchanges build no mask, the plain-matmul path counts its own)."""
    if kern != "torch" or strategy.layout.cp > 1 or strategy.recompute == "full":
        return []
    shape, modules = model.shape, set(strategy.recompute_modules)
    if (strategy.recompute == "selective" and modules & {"attention", "elementwise"}) or plain_matmul_attention(
        model, strategy
    ):
        return []
    split = partition.split_blocks(chunk)
    windowed = [
        i for i in partition.layers(chunk) if split.get(i) != "mlp" and 0 < shape.window(i) < seq_len
    ]  # fmt: skip
    return [Saved(f"attention: window mask [s, s] (bool), layer {i}", float(seq_len) ** 2) for i in windowed]


def _split_offload(kept: list[Saved], offload: bool) -> tuple[float, float]:
    """(device bytes, host bytes) of what the blocks keep: offload moves what passes the hooks from 16 KiB."""
    device = host = 0.0
    for s in kept:
        if offload and s.hooked and s.storage_bytes >= OFFLOAD_MIN_BYTES:
            host += s.host_bytes
        else:
            device += s.nbytes
    return device, host


def shared_tables_bytes(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> float:
    """RoPE's cos/sin tables (cp = 1), kept once for every layer and micro-batch where an attention half keeps
    RoPE's operands (nothing rerun there), unless offload moves (copies of) them instead."""
    if strategy.layout.cp > 1 or strategy.recompute == "full":
        return 0.0
    if strategy.recompute == "selective" and {"attention", "elementwise"} & set(strategy.recompute_modules):
        return 0.0
    table = 2.0 * seq_len * model.shape.head_size  # one of the two [s, d/2] fp32 tables
    return 0.0 if strategy.offload and table >= OFFLOAD_MIN_BYTES else 2 * table


# What saved activations never read of a strategy: the search's ZeRO variants of one strategy share its stages'
# bytes, so the memo's key is every other field (a field added to Strategy joins the key)
_NOT_READ = ("zero", "zero_group", "reduce_every_micro_batch")
_READ = tuple(f.name for f in dataclasses.fields(Strategy) if f.name not in _NOT_READ)
_read = operator.attrgetter(*_READ)


def stage_activations(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int, exact: bool = True
) -> StageActivations:
    """Peak saved activations of pipeline stage ``stage`` over the strategy's schedule (module docstring).
    ``exact=False`` (the planner's search): interleaved schedules count in-flight chunks in closed form
    instead of walking the action list (``in_flight_estimate``), the V schedules walk it at the folded ``m``
    (``v_in_flight_mixes``). Kept inside ``modelpar.plan.memo.search_memo``, by the strategy less what it never
    reads."""
    memo = search_memo.current()
    if memo is None:
        return _stage_activations(model, strategy, seq_len, hardware, stage, exact)
    key = (stage_activations, id(model), _read(strategy), seq_len, id(hardware), stage, exact)
    found = memo.get(key)
    if found is None:
        found = memo[key] = _stage_activations(model, strategy, seq_len, hardware, stage, exact)
    return found


def _stage_activations(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int, exact: bool
) -> StageActivations:
    layout = strategy.layout
    per_chunk = _stage_chunk_bytes(model, strategy, seq_len, hardware, stage)
    working = max(w for _, _, w in per_chunk)
    name, pp, m, vpp = strategy.schedule_name, layout.pp, strategy.micro_batches, layout.vpp
    if not exact and name in V_SCHEDULES:
        counts = v_in_flight_mixes(name, pp, m, stage)
    elif exact or vpp == 1 or name != "interleaved":
        counts = in_flight_mixes(name, pp, m, vpp, stage)
    else:
        counts = (in_flight_estimate(pp, m, vpp, stage),)
    device = max(sum(n * per_chunk[j][0] for j, n in enumerate(mix)) for mix in counts)
    host = max(sum(n * per_chunk[j][1] for j, n in enumerate(mix)) for mix in counts)
    return StageActivations(device + shared_tables_bytes(model, strategy, seq_len, hardware), host, working)


def _chunk_key(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int, offload: bool | None = None
) -> tuple:
    """What a stage's chunks' bytes read: the layout, the strategy's split (its ``stage_layers`` and schedule,
    which places the chunks), the micro-batch, SP, the cp exchange, recompute and offload (or ``offload``)."""
    s, offload = strategy, strategy.offload if offload is None else offload
    key = (id(model), s.layout, s.pipeline, s.stage_layers, s.micro_batch_size, s.sp, s.cp_comm, s.recompute)
    return (*key, s.recompute_modules, offload, seq_len, id(hardware), stage)


@search_memo.per_search(_chunk_key)
def _stage_chunk_bytes(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int
) -> tuple[tuple[float, float, float], ...]:
    """``chunk_bytes`` of each chunk of ``stage``, in ``chunks_of`` order."""
    partition = strategy_partition(model, strategy, seq_len)
    memo: dict = {}
    x_kern = dims(model, strategy, seq_len, hardware), kernels(model, hardware)
    return tuple(
        chunk_bytes(model, strategy, seq_len, hardware, partition, c, memo, x_kern) for c in partition.chunks_of(stage)
    )


def block_bytes(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, layer: int = 0) -> float:
    """What one whole block keeps of one micro-batch on the device (``benchmarks/activation_memory.py``'s
    layer), with RoPE's shared tables, under the strategy's recompute and offload."""
    x = dims(model, strategy, seq_len, hardware)
    device, _, _ = piece_bytes(model, strategy, x, kernels(model, hardware), layer, ("attention", "mlp"))
    return device + shared_tables_bytes(model, strategy, seq_len, hardware)


@search_memo.per_search(
    lambda model, strategy, seq_len, hardware, stage: _chunk_key(model, strategy, seq_len, hardware, stage, True)
)
def offloaded_per_micro_batch(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int
) -> float:
    """Bytes offload copies to the host for one micro-batch through every chunk of ``stage``."""
    partition = strategy_partition(model, strategy, seq_len)
    on = dataclasses.replace(strategy, offload=True)
    memo: dict = {}
    return sum(chunk_bytes(model, on, seq_len, hardware, partition, c, memo)[1] for c in partition.chunks_of(stage))
