"""Layout planner: predict memory and step time of every ``tp x cp x pp x dp`` strategy and rank those that fit.

An analytical model, not a simulator. For one strategy (layout, micro-batching, recompute and offload, ZeRO
0-3, SP) it predicts, on the busiest rank:

Memory (bytes) of our block (``ModelSpec.block="llama"``, the default): ``modelpar.perf.plan_memory``, derived
tensor by tensor from the code and checked against what ``modelpar-bench`` measures (within 10%; exact on the
CPU rows): every tensor a block half, the embedding and the head keep for backward under each recompute mode
and offload, walked along the schedule's action list, and the model states of ZeRO 0-3 (fp32 parameters,
gradients and moments; ZeRO-1's fp32 master shard; zero-0's gradient buckets; FSDP2's gathered weights and
unsharded gradients). ``explain`` says why the chosen strategy runs its ZeRO stage, recompute and offload.

Memory of Megatron-LM's GPT block and engine (``block="gpt"``, the published runs), mixed precision ``bf16``:
18 bytes per parameter = 2 (bf16 weights) + 4 (fp32 gradients) + 12 (fp32 master weights and the two Adam
moments); ZeRO-1 divides the 12 by dp. ``fp32`` (CPU): 16 = 4 + 4 + 8 (no master copy). Activations per
layer per micro-batch (Korthikanti et al. 2022, 16-bit, GPT block; doubled for fp32)::

    none        s*b*h * (10 + 24/t + 5*a*s/(h*t))        with SP:  s*b*h * (34 + 5*a*s/h) / t
    selective   s*b*h * (10 + 24/t)                      with SP:  s*b*h * 34 / t
    full        2*s*b*h (the layer input only)           with SP:  2*s*b*h / t

times the layers of one model chunk times the chunks in flight on that rank, read off the schedules in
``modelpar.pipeline.schedule``: 1F1B holds ``min(m, p - r)`` micro-batches on stage ``r``; interleaved
warms up with ``2*(p - r - 1) + (v - 1)*p`` chunk forwards and holds one more, which on the first stage is
``L * (1 + (p-1)/(p*v))`` layers' worth (Korthikanti et al. 2022, section 4.2.3). Recompute adds one layer's
transient working set; the last stage adds fp32 logits ``4*s*b*V/t``; the first the embedding's dropout mask.

Step time, from the per-rank FLOPs of ``modelpar.model.flops`` (plus recomputed forwards)::

    compute_s  = FLOPs on the busiest rank / (peak * efficiency)
                 + element-wise work tp repeats on every rank (``REPLICATED_PASSES`` [b, s, h] passes per
                 layer, at ``memory_bw``; divided by t with SP) + ``layer_overhead_s`` per layer (host-side
                 dispatch, which no parallelism shrinks)
    tp_comm_s  = per layer per micro-batch 4 collectives (6 with full recompute) of b*s*h elements,
                 ring cost 2(t-1)/t * bytes / bw (+ latency per ring step); NVLink if t <= gpus_per_node;
                 a MoE layer under SP 2 (its MLP has none), plus one all-reduce a step of the fp32 gradients
                 of the experts, which are replicated over tp; and per micro-batch one more for the embedding's
                 output and one for the head's input (one of them on a rank of a pipeline)
    pp_comm_s  = 2 * (v*m + p - 1) p2p transfers of b*s*h/t elements (scatter/gather), not overlapped
    dp_comm_s  = all-reduce 2(d-1)/d * fp32 gradient bytes, exposed fraction (1 - dp_overlap);
                 ZeRO-1: reduce-scatter + all-gather of the fp32 master shards, both exposed
    cp_comm_s  = context parallelism, per layer per micro-batch: ring: cp-1 K/V blocks (2*b*(s/cp)*kv*d) forward,
                 as many K/V and cp dK/dV (fp32) blocks backward, each hidden behind one block's attention
                 (4*b*(s/cp)*(s/2cp)*h FLOPs forward, 2.5x that backward) where it is shorter; all-gather: an
                 all-gather of K/V forward, another and a reduce-scatter of dK/dV backward, exposed
    ep_comm_s  = mixture of experts, per MoE layer per micro-batch: 4 all-to-alls (6 with full recompute), each
                 rank sending its k*b*(s/cp)/t routed rows of h, all but the 1/ep staying home, not overlapped
    bubble_s   = (p-1)/(v*m) * (compute_s + tp_comm_s + cp_comm_s + ep_comm_s)
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
(achievable efficiency, DP overlap); ``tests/test_plan.py`` checks the model against Narayanan et al. 2021.

Left out, so read predictions as +-15%: matmul efficiency falling for small or thin GEMMs (one global factor
instead), TP communication overlapped with compute, the optimizer step, allocator fragmentation, ZB-H1 and
GPipe schedules' time, and, for the GPT block, the memory of an uneven split (the busiest chunk's layers are
assumed on every stage). ``ModelSpec.flash_attention`` drops the GPT block's stored ``s x s`` scores (what a
fused attention kernel does). Recompute adds the rerun FLOPs (full: the block's forward; selective: the
attention or MLP halves named, ``elementwise`` ``RECOMPUTED_PASSES`` element-wise passes) and one tp
collective per rerun half; offload adds its copies over ``Hardware.host_bw`` (``offload_per_micro_batch_s``).

Model presets are ``recipes/model/*.yaml``, read through the recipe schema (``load_model``); the command line,
``modelpar-plan``, is ``modelpar.cli.plan``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
from dataclasses import dataclass

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from modelpar.model.config import ModelConfig
from modelpar.model.flops import training_flops_per_token
from modelpar.parallel.context import CP_COMMS
from modelpar.parallel.layout import LayoutError, ParallelLayout
from modelpar.perf import plan_memory
from modelpar.pipeline.partition import partition_by_cost
from modelpar.training.config import RECIPES, register_schema

GIB = 2**30
RECOMPUTE_MODES = ("none", "selective", "full")
# parallel.recompute_modules the planner tries: the cheap ops, either half, either half plus the other's cheap ops
SELECTIVE_CHOICES = (("elementwise",), ("attention",), ("mlp",), ("attention", "elementwise"), ("mlp", "elementwise"))
MODEL_PRESET_DIR = pathlib.Path(RECIPES) / "model"


class PlanError(ValueError):
    """Impossible planning inputs or no answer; the message is one line naming the problem and a fix."""


# -- inputs --------------------------------------------------------------------------------------------------


BLOCKS = ("llama", "gpt")


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs of a model: its shape (matmul sizes, and whether the head shares the embedding),
    whether attention runs as a fused (flash) kernel that never stores the ``s x s`` scores (the GPT block's
    term; our block never stores them), and which block and engine the memory model describes: ``llama``,
    modelpar's own (``modelpar.perf.plan_memory``: its saved tensors one by one, fp32 parameters and moments)
    or ``gpt``, Megatron-LM's GPT block and engine (Korthikanti et al. 2022's activations, bf16 weights with
    fp32 masters), for the published runs (``modelpar.perf.published``)."""

    shape: ModelConfig
    flash_attention: bool = False
    block: str = "llama"

    def __post_init__(self) -> None:
        if self.block not in BLOCKS:
            raise PlanError(f"block={self.block!r} must be one of {', '.join(BLOCKS)}")

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def tie_embeddings(self) -> bool:
        return self.shape.tie_embeddings


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Bandwidths are bytes/s per device, one direction."""

    name: str
    peak_flops: float  # dense FLOP/s of the training dtype (bf16 on GPUs, fp32 on CPU)
    memory_bytes: float
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int
    latency_s: float  # per message (per ring step of a collective)
    reserved_bytes: float = 2 * GIB  # runtime context, communication buffers, allocator slack
    dtype: str = "bf16"  # bf16: mixed precision with fp32 master weights; fp32: everything fp32
    memory_bw: float = 0.0  # bytes/s one rank's element-wise ops stream at (0: not modelled)
    compute_units: int = 0  # ranks that can compute at once (CPU cores); 0: every rank has its own device
    layer_overhead_s: float = 0.0  # host cost of one layer's fwd+bwd per micro-batch that tp does not shrink
    #   (op dispatch and autograd bookkeeping on CPU, kernel launches on GPU); 0: not modelled
    busy_slowdown: float = 1.0  # compute time x this when ranks share the compute units (CPU cores) and more
    #   than one computes at once; 1.0 with a device per rank
    kernels: str = "triton"  # what model.kernels=auto runs: triton on GPUs, the torch reference on CPU
    host_bw: float = 0.0  # bytes/s between the device and host memory (activation offload); 0: the device's
    #   memory is host memory (a CPU), where offload frees nothing

    @property
    def weight_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    @property
    def optimizer_bytes(self) -> int:
        """Per parameter: fp32 master (bf16 only) and the two fp32 Adam moments."""
        return 12 if self.dtype == "bf16" else 8


GRAD_BYTES = 4  # gradients are accumulated and reduced in fp32 in both dtypes

HARDWARE = {
    # A100 SXM 80GB: 312 TFLOP/s dense bf16; NVLink3 12 links x 25 GB/s per direction; DGX A100 has one
    # 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s).
    # Host link for offload: PCIe 4.0 x16 (~25 GB/s per direction) on A100, PCIe 5.0 x16 (~50 GB/s) on H100/H200.
    "a100-80gb": Hardware("a100-80gb", 312e12, 80 * GIB, 300e9, 25e9, 8, 3e-6, memory_bw=2.0e12, host_bw=25e9),
    # Latency: ~3 us per ring step (NCCL's low-latency protocol), so an 8-GPU all-reduce starts at ~40 us.
    # H100 SXM: 989 TFLOP/s dense bf16; NVLink4 18 links x 25 GB/s; one 400 Gb/s NDR NIC per GPU (50 GB/s).
    # HBM: A100 80GB 2.0 TB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s.
    "h100-80gb": Hardware("h100-80gb", 989e12, 80 * GIB, 450e9, 50e9, 8, 3e-6, memory_bw=3.35e12, host_bw=50e9),
    "h200": Hardware("h200", 989e12, 140 * GIB, 450e9, 50e9, 8, 3e-6, memory_bw=4.8e12, host_bw=50e9),
    # This project's CPU machine, one thread per rank: torch fp32 matmul measured ~90-98 GFLOP/s on one
    # AMD EPYC core; gloo over loopback moves ~1 GB/s with ~0.25 ms per message (2 MB all-reduce ~4 ms,
    # send+recv round trip ~3.5 ms, see DESIGN.md); element-wise ops on [256, 256] fp32 ~10 GB/s with dispatch;
    # 2 cores. Rough: benchmarks/plan_vs_measured.py calibrates all of these in the run it compares.
    "cpu": Hardware(
        "cpu",
        100e9,
        8 * GIB,
        1e9,
        1e9,
        2,
        250e-6,
        reserved_bytes=0.5 * GIB,
        dtype="fp32",
        memory_bw=10e9,
        compute_units=2,
        kernels="torch",
    ),
}


@dataclass(frozen=True)
class CostModel:
    """The model's two calibration knobs, global (never per case).

    ``efficiency``: fraction of peak the matmul-dominated compute reaches (kernels, non-matmul ops, launch
    gaps, optimizer step all folded in). ``dp_overlap``: fraction of the DP gradient all-reduce hidden behind
    backward (modelpar's buckets reduce during the last micro-batch's backward).
    """

    efficiency: float = 0.55
    dp_overlap: float = 0.5


@dataclass(frozen=True)
class Strategy:
    """One way to run a step: the layout plus micro-batching, activation recompute and offload, ZeRO and SP.

    ``recompute_modules`` (our block, ``recompute="selective"``): what ``parallel.recompute_modules`` reruns
    (attention | mlp | elementwise); the GPT block's selective is Megatron's (the attention core). The rest
    describe a run the planner does not choose but predicts for ``modelpar-bench``: ``zero_group`` (hybrid
    sharding, ``optim.zero_group``), ``stage_layers`` (the chunks' layer counts; empty: the trainer's default
    split) and ``pipeline`` (the schedule, where not 1F1B or interleaved). ``reduce_every_micro_batch``
    (ZeRO-2/3: no unsharded gradients kept across micro-batches, m reduce-scatters) the search tries, like
    offload, where a strategy does not fit without it."""

    layout: ParallelLayout
    micro_batch_size: int
    micro_batches: int
    recompute: str = "none"  # none | selective | full
    zero: int = 0  # optim.zero: 1 shards the optimizer state over dp x cp, 2 also gradients, 3 also weights
    sp: bool = False
    cp_comm: str = "ring"  # ring | allgather, when layout.cp > 1
    recompute_modules: tuple[str, ...] = ("elementwise",)
    offload: bool = False  # parallel.offload_activations
    zero_group: int = 0
    stage_layers: tuple[float, ...] = ()
    pipeline: str = ""
    reduce_every_micro_batch: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero", int(self.zero))  # True/False from older callers: stage 1 / 0
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))

    @property
    def zero1(self) -> bool:
        """The optimizer state is sharded (any ZeRO stage)."""
        return self.zero >= 1

    @property
    def global_batch(self) -> int:
        return self.layout.dp * self.micro_batch_size * self.micro_batches

    @property
    def schedule(self) -> str:
        if self.layout.pp == 1:
            return "none"
        return self.schedule_name

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule's name as ``build_schedule`` knows it (1f1b on one stage too)."""
        return self.pipeline or ("interleaved" if self.layout.vpp > 1 else "1f1b")

    @property
    def recompute_label(self) -> str:
        """``none``, ``full`` or ``selective(attention+mlp)``, the modules rerun."""
        if self.recompute != "selective":
            return self.recompute
        return f"selective({'+'.join(self.recompute_modules)})"

    def __str__(self) -> str:
        flags = [f"b{self.micro_batch_size}", f"m{self.micro_batches}", f"rc-{self.recompute_label}"]
        flags += [f"zero{self.zero}"] * self.zero1 + ["sp"] * self.sp + [self.cp_comm] * (self.layout.cp > 1)
        flags += ["reduce-every-mb"] * self.reduce_every_micro_batch + ["offload"] * self.offload
        return f"{self.layout} {' '.join(flags)}"


# -- outputs -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one rank; ``stage`` names which pipeline stage (first, last, or ``stage r``) this is.

    ``weights``, ``grads``, ``optimizer`` and ``buffers`` (zero-0's gradient buckets) are held at the optimizer
    step; ``gathered`` is FSDP2's unsharded weights and gradients at their peak (ZeRO-2/3). ``activations`` is
    what the step needs for them at its peak: ``saved`` (kept on the device between forward and backward),
    the ``working`` set a recomputed half rebuilds, and the ``host`` copies of offload where the device's
    memory is host memory (a CPU); on a GPU ``host`` is pinned host memory, not counted against the device."""

    stage: str
    weights: float
    grads: float
    optimizer: float
    activations: float
    reserved: float
    gathered: float = 0.0
    buffers: float = 0.0
    saved: float = 0.0
    working: float = 0.0
    host: float = 0.0

    @property
    def states(self) -> float:
        """Model-state bytes: weights, gradients, optimizer state, buffers and gathered copies."""
        return self.weights + self.grads + self.optimizer + self.buffers + self.gathered

    @property
    def total(self) -> float:
        return self.states + self.activations + self.reserved


@dataclass(frozen=True)
class Prediction:
    """Predicted step of one strategy: seconds per component on the busiest rank, memory on the fullest."""

    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # exposed part only
    bubble_s: float
    memory: MemoryBreakdown
    fits: bool
    tokens_per_s: float
    model_flops_per_step: float  # modelpar.model.flops convention, no recompute
    hardware_flops_per_step: float  # including recomputed forwards
    mfu: float
    hfu: float
    cp_comm_s: float = 0.0  # exposed part only
    ep_comm_s: float = 0.0  # MoE all-to-alls, exposed
    offload_s: float = 0.0  # activation offload's copies to host memory and back

    @property
    def total_s(self) -> float:
        comm = self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.cp_comm_s + self.ep_comm_s
        return self.compute_s + comm + self.bubble_s + self.offload_s

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["total_s"] = self.total_s
        out["memory"]["total"] = self.memory.total
        return out


@dataclass(frozen=True)
class PlannedLayout:
    strategy: Strategy
    prediction: Prediction

    def as_dict(self) -> dict:
        s = self.strategy
        return {
            "tp": s.layout.tp,
            "cp": s.layout.cp,
            "cp_comm": s.cp_comm if s.layout.cp > 1 else None,
            "pp": s.layout.pp,
            "dp": s.layout.dp,
            "vpp": s.layout.vpp,
            "schedule": s.schedule,
            "micro_batch_size": s.micro_batch_size,
            "micro_batches": s.micro_batches,
            "recompute": s.recompute,
            "recompute_modules": list(s.recompute_modules) if s.recompute == "selective" else [],
            "offload": s.offload,
            "reduce_every_micro_batch": s.reduce_every_micro_batch,
            "zero1": s.zero1,
            "zero": s.zero,
            "sp": s.sp,
            **self.prediction.as_dict(),
        }


# -- the model's pieces --------------------------------------------------------------------------------------


def layers_per_chunk(layers: int, layout: ParallelLayout) -> int:
    """Layers in the busiest model chunk (uneven splits give some chunk one more)."""
    return math.ceil(layers / (layout.pp * layout.vpp))


def chunks_in_flight(strategy: Strategy, stage: int) -> int:
    """Model chunks whose activations stage ``stage`` holds at its peak under the strategy's schedule."""
    p, v, m = strategy.layout.pp, strategy.layout.vpp, strategy.micro_batches
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


def _kv_width(model: ModelSpec, tp: int) -> float:
    """K (or V) elements per token on one tp rank: its kv heads (one, replicated, when kv_heads < tp) x d."""
    shape = model.shape
    return max(1.0, shape.kv_heads / tp) * shape.head_dim


def recompute_working_bytes(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> float:
    """Transient activations rebuilt while one layer's backward runs (nothing without recompute)."""
    if strategy.recompute == "none":
        return 0.0
    full = dataclasses.replace(strategy, recompute="none")
    kept = activation_bytes_per_layer(model, strategy, seq_len, hardware)
    return activation_bytes_per_layer(model, full, seq_len, hardware) - kept


def stage_params(model: ModelSpec, layout: ParallelLayout, stage: int) -> float:
    """Parameters stored on a rank of pipeline stage ``stage`` (its tp shard)."""
    shape, t = model.shape, layout.tp
    layer = stored_block_params(shape, layout) + 2 * shape.hidden  # norms are replicated over tp
    params = layers_per_chunk(shape.layers, layout) * layout.vpp * layer
    embedding = shape.vocab_size * shape.hidden / t
    first, last = stage == 0, stage == layout.pp - 1
    if first:
        params += embedding
    if last:
        params += shape.hidden + (0 if first and model.tie_embeddings else embedding)
    return params


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


def rerun_halves(model: ModelSpec, strategy: Strategy) -> tuple[str, ...]:
    """The block halves whose forward backward reruns: both under full recompute; under our selective those
    named in ``recompute_modules``, and with ``elementwise`` the others too (their cheap ops)."""
    if strategy.recompute == "full":
        return ("attention", "mlp")
    if strategy.recompute != "selective" or model.block == "gpt":
        return ()
    modules = set(strategy.recompute_modules)
    return tuple(h for h in ("attention", "mlp") if h in modules or "elementwise" in modules)


def collectives_per_layer(model: ModelSpec, strategy: Strategy) -> int:
    """Tensor-parallel collectives of one layer and micro-batch: 2 forward, 2 backward, and each rerun
    half's forward one again."""
    return 4 + len(rerun_halves(model, strategy))


def tp_collectives_per_layer(model: ModelSpec, strategy: Strategy, moe_share: float) -> float:
    """``collectives_per_layer``, the mean over the layers: under sequence parallelism a mixture-of-experts MLP
    routes this rank's own tokens to experts replicated over tp, so its half has no tp collective (the experts'
    gradients are summed over tp once a step instead)."""
    count = collectives_per_layer(model, strategy)
    if strategy.sp and moe_share:
        count -= moe_share * (2 + ("mlp" in rerun_halves(model, strategy)))
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
        return 4.0 * tokens * shape.hidden * seq_len
    modules, extra = set(strategy.recompute_modules), 0.0
    if "attention" in modules:
        extra += 2.0 * tokens * shape.attention_params() + 4.0 * tokens * shape.hidden * seq_len
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


def stage_memory(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, stage: int, *, exact: bool = True
) -> MemoryBreakdown:
    """Bytes on a rank of pipeline stage ``stage``: our block's exact tables (``plan_memory``), or the GPT
    block's Korthikanti et al. terms with Megatron's model states (``model.block == "gpt"``). ``exact=False``:
    interleaved schedules' in-flight chunks in closed form (the search's shortcut)."""
    layout = strategy.layout
    label = "first" if stage == 0 else "last" if stage == layout.pp - 1 else f"stage {stage}"
    if model.block == "gpt":
        return _gpt_stage_memory(model, strategy, seq_len, hardware, stage, label)
    states = plan_memory.state_bytes(model, strategy, seq_len, stage, plan_memory.activation_bytes(hardware))
    act = plan_memory.stage_activations(model, strategy, seq_len, hardware, stage, exact=exact)
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
    params = stage_params(model, layout, stage)
    s, b, h, t = seq_len / layout.cp, strategy.micro_batch_size, model.shape.hidden, layout.tp
    in_flight = chunks_in_flight(strategy, stage)
    per_layer = activation_bytes_per_layer(model, strategy, seq_len, hardware)
    activations = per_layer * layers_per_chunk(model.shape.layers, layout) * in_flight
    working = recompute_working_bytes(model, strategy, seq_len, hardware)
    if stage == 0:
        activations += s * b * h * in_flight / (t if strategy.sp else 1)  # embedding dropout mask, 1 byte
    if stage == layout.pp - 1:
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


def recipe_strategy(cfg) -> Strategy:
    """The strategy a training recipe (``TrainConfig``) runs: its layout, micro-batching, recompute, offload,
    ZeRO stage and group, and the trainer's own pipeline split (``build_partition``)."""
    from modelpar.training.build import build_partition  # training is above perf's planner in the import order

    p = cfg.parallel
    layout = p.layout()
    return Strategy(
        layout,
        cfg.data.global_batch // (layout.dp * p.microbatches),
        p.microbatches,
        p.recompute,
        cfg.optim.zero,
        p.sp and p.tp > 1,
        p.cp_comm,
        recompute_modules=tuple(p.recompute_modules),
        offload=p.offload_activations,
        zero_group=cfg.optim.zero_group,
        stage_layers=build_partition(cfg).layer_counts,
        pipeline=p.schedule if p.pp > 1 else "",
        reduce_every_micro_batch=cfg.optim.reduce_every_micro_batch,
    )


def recipe_memory(cfg, hardware: Hardware | None = None) -> list[MemoryBreakdown]:
    """Predicted bytes on the fullest rank of every pipeline stage of a training recipe, on ``hardware`` (by
    default the ``cpu`` preset in the recipe's dtype): what ``modelpar-bench`` measures beside it."""
    hardware = hardware or dataclasses.replace(HARDWARE["cpu"], dtype="bf16" if cfg.trainer.dtype == "bf16" else "fp32")
    strategy = recipe_strategy(cfg)
    model = ModelSpec(cfg.model)
    return [stage_memory(model, strategy, cfg.data.seq_len, hardware, r) for r in range(strategy.layout.pp)]


def peak_memory(
    model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware, *, exact: bool = True
) -> MemoryBreakdown:
    """The fuller of the first stage (most micro-batches in flight) and the last (head and logits)."""
    stages = {0, strategy.layout.pp - 1}
    memories = (stage_memory(model, strategy, seq_len, hardware, st, exact=exact) for st in stages)
    return max(memories, key=lambda m: m.total)


def ring_all_reduce_s(nbytes: float, ranks: int, bandwidth: float, latency_s: float) -> float:
    """Ring all-reduce: reduce-scatter then all-gather, 2(n-1) steps each moving nbytes/n."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency_s


def ring_all_gather_s(nbytes: float, ranks: int, bandwidth: float, latency_s: float) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of ``nbytes`` in total: n-1 steps of nbytes/n."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency_s


def group_bandwidth(hardware: Hardware, span: int) -> float:
    """Bandwidth of a group whose ranks lie within ``span`` consecutive ranks: NVLink if one node holds it."""
    return hardware.intra_node_bw if span <= hardware.gpus_per_node else hardware.inter_node_bw


def layer_forward_flops(shape: ModelConfig, tokens: int, seq_len: int) -> float:
    """One block's forward: matmul weights plus attention's score and value matmuls (as in modelpar.model.flops)."""
    return 2.0 * tokens * shape.block_params() + 4.0 * tokens * shape.hidden * seq_len


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
    rerun = RECOMPUTED_PASSES if "elementwise" in _selective_modules(model, strategy) else 0
    return (
        overhead
        + layers * nbytes * (REPLICATED_PASSES / (layout.tp if strategy.sp else 1) + rerun) / hardware.memory_bw
    )


def _selective_modules(model: ModelSpec, strategy: Strategy) -> tuple[str, ...]:
    return strategy.recompute_modules if strategy.recompute == "selective" and model.block == "llama" else ()


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
    attention_share = (2.0 * tokens * shape.attention_params() + 4.0 * tokens * shape.hidden * seq_len) / forward
    return block * _busiest_rank_blocks(
        shape.layers, layout.pp, layout.vpp, round(head / block, 4), round(attention_share, 4)
    )


@functools.lru_cache(maxsize=4096)
def _busiest_rank_blocks(layers: int, pp: int, vpp: int, head_in_blocks: float, attention_share: float) -> float:
    """Cost of the busiest rank, in blocks, under the trainer's FLOP-balanced split in half blocks (attention
    costs ``attention_share`` of a block, the MLP the rest, the head ``head_in_blocks``)."""
    halves = [attention_share, 1.0 - attention_share] * layers
    split = partition_by_cost(halves, pp, vpp, head_cost=head_in_blocks, halves=True)

    def cost(chunk: int) -> float:
        start, stop = split.half_range(chunk)
        return sum(halves[start:stop]) + head_in_blocks * split.has_head(chunk)

    return max(sum(cost(c) for c in split.chunks_of(rank)) for rank in range(pp))


def hardware_flops_per_step(model: ModelSpec, strategy: Strategy, seq_len: int) -> float:
    """Model FLOPs of the whole step plus the forwards that recompute runs again."""
    shape, tokens = model.shape, strategy.global_batch * seq_len
    extra = recompute_extra_flops(model, strategy, tokens, seq_len)
    return training_flops_per_token(shape, seq_len) * tokens + shape.layers * extra


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
    compute_s = m * stage_step_flops(model, strategy, seq_len) / t / cp / rate
    compute_s += m * replicated_elementwise_s(model, strategy, seq_len, hardware)

    act_bytes = b * seq_len / cp * shape.hidden * hardware.weight_bytes  # one [b, s/cp, h] activation
    layers_on_rank = layers_per_chunk(shape.layers, layout) * v
    tp_bw = group_bandwidth(hardware, t)
    moe_share = sum(shape.moe.is_moe_layer(i) for i in range(shape.layers)) / shape.layers
    tp_comm_s = m * layers_on_rank * tp_collectives_per_layer(model, strategy, moe_share)
    tp_comm_s += m * (2 if p == 1 else 1)  # the vocab-parallel embedding's output and the head's input, once each
    tp_comm_s *= ring_all_reduce_s(act_bytes, t, tp_bw, hardware.latency_s)
    experts = layers_on_rank * moe_share * shape.moe.experts / layout.ep * 3 * shape.hidden * shape.expert_ffn_hidden
    tp_comm_s += ring_all_reduce_s(experts * GRAD_BYTES, t, tp_bw, hardware.latency_s) if shape.moe.enabled else 0.0

    pp_comm_s = 0.0
    if p > 1:
        # Scatter/gather (Narayanan et al. 2021, 4.1): each tp rank sends 1/t of the activation, the receiver
        # all-gathers it over NVLink; with SP the activation is already sharded.
        link = group_bandwidth(hardware, t * p)
        p2p_s = act_bytes / t / link + hardware.latency_s
        if not strategy.sp:
            p2p_s += ring_all_gather_s(act_bytes, t, hardware.intra_node_bw, hardware.latency_s)
        pp_comm_s = 2 * (v * m + p - 1) * p2p_s

    dp_comm_s = dp_exposed_s(model, strategy, hardware, costs)
    cp_comm_s = m * layers_on_rank * cp_exposed_per_layer_s(model, strategy, hardware, seq_len, rate)
    ep_comm_s = m * layers_on_rank * moe_share * ep_comm_per_layer_s(model, strategy, hardware, seq_len)
    bubble_s = (p - 1) / (v * m) * (compute_s + tp_comm_s + cp_comm_s + ep_comm_s)
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
    total_s = compute_s + tp_comm_s + pp_comm_s + dp_comm_s + cp_comm_s + ep_comm_s + bubble_s + offload_s
    tokens = strategy.global_batch * seq_len
    model_flops = training_flops_per_token(shape, seq_len) * tokens
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
    )


def offload_per_micro_batch_s(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> float:
    """Activation offload of one micro-batch on the first stage: every moved byte out to host memory in
    forward and back in backward over ``host_bw``, not overlapped (the copies are queued on the compute
    stream); on a CPU (``host_bw`` 0) one copy at ``memory_bw``."""
    if not strategy.offload or model.block == "gpt":
        return 0.0
    moved = plan_memory.offloaded_per_micro_batch(model, strategy, seq_len, hardware, stage=0)
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
    kv_elements = 2 * b * seq_len / cp * _kv_width(model, t)  # this rank's K and V
    forwards = 2 if "attention" in rerun_halves(model, strategy) else 1
    if strategy.cp_comm == "allgather":  # gathered each forward, again in backward, then dK/dV reduce-scattered
        gather = ring_all_gather_s(kv_elements * cp * hardware.weight_bytes, cp, bw, hardware.latency_s)
        return (forwards + 2) * gather
    send = kv_elements * hardware.weight_bytes / bw + hardware.latency_s
    send_grad = kv_elements * GRAD_BYTES / bw + hardware.latency_s
    block_forward = 4 * b * (seq_len / cp) * (seq_len / (2 * cp)) * model.shape.hidden / t / rate
    forward = (cp - 1) * max(0.0, send - block_forward)
    backward = (cp - 1) * max(0.0, send + send_grad - 2.5 * block_forward) + send_grad  # the last dK/dV: home
    return forwards * forward + backward


def dp_exposed_s(model: ModelSpec, strategy: Strategy, hardware: Hardware, costs: CostModel) -> float:
    """Data-parallel gradient sync left on the critical path, plus the tied-embedding sync between stages."""
    layout = strategy.layout
    t, p = layout.tp, layout.pp
    d = layout.dp * layout.cp  # weights are replicated over dp x cp, gradients reduced over both
    params = max(stage_params(model, layout, st) for st in {0, p - 1})
    bw = group_bandwidth(hardware, layout.world_size)
    exposed = 0.0
    if d > 1 and strategy.zero >= 2:
        # FSDP2 reduce-scatters every block's gradients once, after its last micro-batch's backward, and at
        # stage 3 all-gathers its weights before each forward and backward; prefetching hides the dp_overlap share
        m = strategy.micro_batches
        scatters = m if strategy.reduce_every_micro_batch else 1  # optim.reduce_every_micro_batch: m x the traffic
        moved = scatters * ring_all_gather_s(params * GRAD_BYTES, d, bw, hardware.latency_s)
        if strategy.zero >= 3:
            moved += 2 * m * ring_all_gather_s(params * hardware.weight_bytes, d, bw, hardware.latency_s)
        exposed = (1 - costs.dp_overlap) * moved
    elif d > 1 and strategy.zero1:
        # modelpar's ZeRO-1 reduce-scatters after backward and all-gathers fp32 masters after the step.
        exposed = 2 * ring_all_gather_s(params * GRAD_BYTES, d, bw, hardware.latency_s)
    elif d > 1:
        exposed = (1 - costs.dp_overlap) * ring_all_reduce_s(params * GRAD_BYTES, d, bw, hardware.latency_s)
    if p > 1 and model.tie_embeddings:
        embedding = model.shape.vocab_size * model.shape.hidden / t * GRAD_BYTES
        exposed += ring_all_reduce_s(embedding, 2, group_bandwidth(hardware, t * p), hardware.latency_s)
    return exposed


# -- search --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchSpace:
    """Which strategies ``plan`` tries; ``None`` leaves a degree free. Every choice is a tuple of options."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None  # expert parallel degree (mixture-of-experts models; free: every divisor of dp x cp)
    cp_comm: tuple[str, ...] = ("ring", "allgather")
    max_vpp: int = 4
    max_micro_batch_size: int = 8
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    # what our block's selective recompute may rerun (parallel.recompute_modules); the GPT block has one selective
    recompute_modules: tuple[tuple[str, ...], ...] = SELECTIVE_CHOICES
    zero: tuple[int, ...] = (0, 1, 2, 3)  # optim.zero stages to try
    sp: tuple[bool, ...] = (False, True)
    offload: tuple[bool, ...] = (False, True)  # parallel.offload_activations; True is tried where False misses


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _candidate_layouts(gpus: int, space: SearchSpace, experts: bool = False) -> list[ParallelLayout]:
    """Every ``tp x cp x pp x dp = gpus`` (vpp = 1) the search space allows; with ``experts``, every ep too."""
    out = []
    for tp in _divisors(gpus):
        for cp in _divisors(gpus // tp):
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                pins = ((space.tp, tp), (space.cp, cp), (space.pp, pp), (space.dp, dp))
                if all(want is None or want == got for want, got in pins):
                    for ep in _divisors(dp * cp) if experts else (1,):
                        if space.ep is None or space.ep == ep:
                            out.append(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep))
    return out


def layout_problem(
    model: ModelSpec, layout: ParallelLayout, global_batch: int, seq_len: int | None = None
) -> str | None:
    """Why ``layout`` cannot run ``model`` (the trainer's own checks, one line), or None."""
    if global_batch % layout.dp:
        return f"dp={layout.dp} does not divide the global batch {global_batch}"
    if seq_len is not None and layout.cp > 1 and seq_len % (2 * layout.cp):
        return f"cp={layout.cp} does not cut seq_len={seq_len} into 2*cp equal chunks"
    try:
        model.shape.check_layout(layout)
    except LayoutError as exc:
        return str(exc)
    return None


def valid_layouts(
    model: ModelSpec, gpus: int, global_batch: int, space: SearchSpace, seq_len: int | None = None
) -> list[ParallelLayout]:
    """Every ``tp x cp x pp x dp = gpus`` (vpp = 1) that shards the model and splits the batch (and sequence)."""
    return [
        layout
        for layout in _candidate_layouts(gpus, space, model.shape.moe.enabled)
        if layout_problem(model, layout, global_batch, seq_len) is None
    ]


def strategies(model: ModelSpec, layout: ParallelLayout, global_batch: int, seq_len: int, space: SearchSpace):
    """Every micro-batching, interleaving, recompute (and our selective's modules), ZeRO and SP choice for one
    ``tp x pp x dp``, without offload (``plan`` adds it where a strategy does not fit)."""
    per_replica = global_batch // layout.dp
    for b in (k for k in _divisors(per_replica) if k <= space.max_micro_batch_size):
        m = per_replica // b
        for v in range(1, space.max_vpp + 1 if layout.pp > 1 else 2):
            # modelpar's interleaved schedule walks micro-batches in groups of pp.
            if v > 1 and (m % layout.pp or layout.pp * v > model.shape.layers):
                continue
            chunked = dataclasses.replace(layout, vpp=v)
            for recompute in space.recompute:
                choices = space.recompute_modules if recompute == "selective" and model.block == "llama" else ((),)
                for modules in choices or (("elementwise",),):
                    for zero in _zero_stages(model, layout, space):
                        for sp in space.sp if layout.tp > 1 and seq_len % (layout.tp * layout.cp) == 0 else (False,):
                            for comm in space.cp_comm if layout.cp > 1 else ("ring",):
                                extra = {"recompute_modules": modules} if modules else {}
                                yield Strategy(chunked, b, m, recompute, zero, sp, comm, **extra)


def _zero_stages(model: ModelSpec, layout: ParallelLayout, space: SearchSpace) -> tuple[int, ...]:
    """The ZeRO stages worth trying: none without dp x cp. With ep > 1 the trainer shards expert weights over the
    expert data-parallel group (dp x cp / ep ranks), which the memory and time model do not describe yet: the
    planner keeps those layouts at zero-0 rather than predict a sharding the trainer does not do."""
    if layout.dp * layout.cp == 1 or layout.ep > 1:
        return (0,)
    return tuple(space.zero)


def plan(
    model: ModelSpec,
    hardware: Hardware,
    *,
    gpus: int,
    global_batch: int,
    seq_len: int,
    costs: CostModel | None = None,
    space: SearchSpace | None = None,
) -> list[PlannedLayout]:
    """Strategies that fit in memory, fastest first (tokens/s, then less memory). Raises ``PlanError``.

    Recompute and offload only ever add time, so a strategy that fits without them is not tried with them
    (its recomputing variants would rank below it), and offload is tried only where a strategy misses."""
    space = space or SearchSpace()
    check_inputs(gpus=gpus, global_batch=global_batch, seq_len=seq_len, space=space)
    layouts = valid_layouts(model, gpus, global_batch, space, seq_len)
    if not layouts:
        raise PlanError(no_layout_message(model, gpus, global_batch, space, seq_len))
    planned, closest = [], None
    fits_as_is: set[Strategy] = set()  # strategies that fit without recompute: recomputing them only costs time
    for layout in layouts:
        for strategy in strategies(model, layout, global_batch, seq_len, space):
            if strategy.recompute != "none" and _without_recompute(strategy) in fits_as_is:
                continue
            prediction = predict(strategy, model, hardware, seq_len=seq_len, costs=costs)
            if strategy.recompute == "none" and prediction.fits:
                fits_as_is.add(strategy)
            if not prediction.fits:
                # reducing every micro-batch and offload only cost time: tried only where the strategy misses
                for change in _memory_savers(model, strategy, hardware, space):
                    trial = dataclasses.replace(strategy, **change)
                    guess = predict(trial, model, hardware, seq_len=seq_len, costs=costs)
                    if guess.fits or guess.memory.total < prediction.memory.total:
                        strategy, prediction = trial, guess
                    if guess.fits:
                        break
            entry = PlannedLayout(strategy, prediction)
            if prediction.fits:
                planned.append(entry)
            elif closest is None or prediction.memory.total < closest.prediction.memory.total:
                closest = entry
    if not planned:
        raise PlanError(nothing_fits_message(closest, hardware))
    planned.sort(key=lambda e: (-e.prediction.tokens_per_s, e.prediction.memory.total))
    return planned


def _without_recompute(strategy: Strategy) -> Strategy:
    return dataclasses.replace(strategy, recompute="none", recompute_modules=Strategy.recompute_modules)


def _memory_savers(model: ModelSpec, strategy: Strategy, hardware: Hardware, space: SearchSpace) -> list[dict]:
    """What else could make ``strategy`` fit, cheapest first: ZeRO-2/3 reducing every micro-batch's gradients
    (FSDP2 then keeps no unsharded gradients across them), offload (our block, a device with its own memory:
    not a CPU), both."""
    savers = []
    if strategy.zero >= 2 and strategy.micro_batches > 1 and strategy.layout.dp * strategy.layout.cp > 1:
        savers.append({"reduce_every_micro_batch": True})
    if True in space.offload and model.block == "llama" and hardware.host_bw:
        savers.append({"offload": True})
        if savers[0] != {"offload": True}:
            savers.append({"reduce_every_micro_batch": True, "offload": True})
    return savers


def check_inputs(*, gpus: int, global_batch: int, seq_len: int, space: SearchSpace) -> None:
    for name, value in (("gpus", gpus), ("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    for name in ("tp", "cp", "pp", "dp"):
        want = getattr(space, name)
        if want is not None and (want < 1 or gpus % want):
            raise PlanError(f"{name}={want} does not divide gpus={gpus}; try {name} in {_divisors(gpus)}")
    if not space.cp_comm or any(c not in CP_COMMS for c in space.cp_comm):
        raise PlanError(f"cp_comm={list(space.cp_comm)} must list ways from {', '.join(CP_COMMS)}")
    bad = [r for r in space.recompute if r not in RECOMPUTE_MODES]
    if bad or not space.recompute:
        raise PlanError(f"recompute={list(space.recompute)} must list modes from {', '.join(RECOMPUTE_MODES)}")
    known = ("attention", "mlp", "elementwise")
    for modules in space.recompute_modules:
        if not modules or set(modules) - set(known):
            raise PlanError(f"recompute_modules={list(modules)} must name some of {', '.join(known)}")


def explain(
    best: PlannedLayout,
    model: ModelSpec,
    hardware: Hardware,
    *,
    seq_len: int,
    costs: CostModel | None = None,
    space: SearchSpace | None = None,
) -> list[str]:
    """Why the chosen strategy runs its ZeRO stage, recompute and offload: one line each, from predicting the
    same strategy with that one choice changed (what would not fit, and what would be slower)."""
    space = space or SearchSpace()
    s, gib = best.strategy, hardware.memory_bytes / GIB

    def variant(**change) -> Prediction:
        return predict(dataclasses.replace(s, **change), model, hardware, seq_len=seq_len, costs=costs)

    def against(label: str, p: Prediction) -> str:
        if not p.fits:
            states = (p.memory.states + p.memory.reserved) / GIB
            return f"{label} needs {p.memory.total / GIB:.1f} GiB ({states:.1f} of it model states)"
        slower = best.prediction.tokens_per_s / p.tokens_per_s - 1
        way = "slower" if slower >= 0 else "faster"
        return f"{label} fits at {p.memory.total / GIB:.1f} GiB but is {abs(slower):.0%} {way}"

    chosen = f"{best.prediction.memory.total / GIB:.1f} of {gib:.0f} GiB"
    stages = [z for z in _zero_stages(model, s.layout, space) if z != s.zero]
    what = {0: "nothing sharded", 1: "optimizer state sharded", 2: "gradients too", 3: "weights too"}
    every = ", gradients reduced every micro-batch" if s.reduce_every_micro_batch else ""
    zero = f"zero-{s.zero} ({what[s.zero]}{every}, {chosen})"
    if s.reduce_every_micro_batch:
        stages = [z for z in stages if z < 2]
        zero += (
            ": " + against("reducing once a step", variant(reduce_every_micro_batch=False)) + ("; " if stages else "")
        )
        if stages:
            zero += "; ".join(against(f"zero-{z}", variant(zero=z, reduce_every_micro_batch=False)) for z in stages)
        stages = []
    if stages:
        zero += ": " + "; ".join(against(f"zero-{z}", variant(zero=z)) for z in stages)
    elif not s.reduce_every_micro_batch:
        if s.layout.dp * s.layout.cp == 1:
            zero += ": no dp x cp replicas to shard over"
        elif s.layout.ep > 1:
            zero += ": not searched with expert parallelism (ep > 1)"
    # the other modes: none, the best of the selective choices (the fastest that fits, else the smallest), full
    options = []
    if s.recompute != "none" and "none" in space.recompute:
        options.append(dataclasses.replace(s, recompute="none"))
    if "selective" in space.recompute:
        choices = space.recompute_modules if model.block == "llama" else (s.recompute_modules,)
        others = [
            dataclasses.replace(s, recompute="selective", recompute_modules=mods)
            for mods in choices
            if (s.recompute, s.recompute_modules) != ("selective", tuple(mods))
        ]
        scored = [(o, predict(o, model, hardware, seq_len=seq_len, costs=costs)) for o in others]
        if scored:
            options.append(
                max(scored, key=lambda op: (op[1].fits, op[1].tokens_per_s if op[1].fits else -op[1].memory.total))[0]
            )
    if s.recompute != "full" and "full" in space.recompute:
        options.append(dataclasses.replace(s, recompute="full"))
    recompute = f"recompute {s.recompute_label}"
    if options:
        recompute += ": " + "; ".join(
            against(o.recompute_label, predict(o, model, hardware, seq_len=seq_len, costs=costs)) for o in options
        )
    if s.offload:
        offload = "offload on: " + against("without it", variant(offload=False))
    elif model.block == "gpt":
        offload = "offload: not modelled for the GPT block"
    elif not hardware.host_bw:
        offload = f"offload off: {hardware.name}'s memory is host memory, moving activations there frees nothing"
    else:
        moved = plan_memory.offloaded_per_micro_batch(model, s, seq_len, hardware, stage=0) * s.micro_batches
        m_s = (
            offload_per_micro_batch_s(model, dataclasses.replace(s, offload=True), seq_len, hardware) * s.micro_batches
        )
        offload = (
            f"offload off: it fits without; moving {moved / GIB:.1f} GiB a step over "
            f"{hardware.host_bw / 1e9:.0f} GB/s would add {m_s:.2f} s"
        )
    return [f"why {zero}", f"why {recompute}", f"why {offload}"]


def no_layout_message(
    model: ModelSpec, gpus: int, global_batch: int, space: SearchSpace, seq_len: int | None = None
) -> str:
    candidates = sorted(range(max(1, gpus - 64), gpus + 65), key=lambda n: (abs(n - gpus), n))
    nearest = [n for n in candidates if n != gpus and valid_layouts(model, n, global_batch, space, seq_len)][:3]
    fix = f"try {' or '.join(map(str, sorted(nearest)))} GPUs" if nearest else "change the GPU count or the batch"
    problems = []
    for layout in _candidate_layouts(gpus, space):
        problem = layout_problem(model, layout, global_batch, seq_len)
        if problem is not None and problem not in problems:
            problems.append(problem)
    why = "; ".join(problems[:2]) + (f" (and {len(problems) - 2} more)" if len(problems) > 2 else "")
    if not problems:
        why = f"the search space allows no factorisation of {gpus} GPUs"
    return f"no tp x pp x dp factorisation of {gpus} GPUs suits {model.name}: {why}; {fix}"


def nothing_fits_message(closest: PlannedLayout, hardware: Hardware) -> str:
    memory = closest.prediction.memory
    states = memory.weights + memory.grads + memory.optimizer + memory.reserved
    fix = (
        "the model states alone exceed the device: add GPUs or memory"
        if states > hardware.memory_bytes
        else "shorten the micro-batch/sequence or add GPUs"
    )
    return (
        f"nothing fits in {hardware.memory_bytes / GIB:.1f} GiB per device: the closest, {closest.strategy}, needs "
        f"{memory.total / GIB:.1f} GiB on its {memory.stage} stage, missing by "
        f"{(memory.total - hardware.memory_bytes) / GIB:.1f} GiB; {fix}"
    )


# -- presets -------------------------------------------------------------------------------------------------


def model_presets() -> list[str]:
    return sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.yaml"))


def load_model(name: str) -> ModelSpec:
    """A model preset, ``recipes/model/<name>.yaml``, read through the recipe schema as the trainer reads it:
    an unknown field or a value of the wrong type is refused (``PlanError``, one line)."""
    if not (MODEL_PRESET_DIR / f"{name}.yaml").is_file():
        raise PlanError(f"unknown model preset {name!r}; choose one of {', '.join(model_presets())}")
    register_schema()
    try:
        with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
            shape = OmegaConf.to_object(compose(config_name="train", overrides=[f"model={name}"]).model)
    except (HydraException, OmegaConfBaseException) as exc:
        # Hydra's message: a header line, then the schema's complaint (the field, its value or type) and its key
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        problem = ", ".join(line for line in lines[1:] if not line.startswith(("reference_type", "object_type")))
        raise PlanError(f"model preset {name!r} (recipes/model/{name}.yaml): {problem or str(exc)}") from None
    return ModelSpec(shape)


def load_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise PlanError(f"unknown hardware preset {name!r}; choose one of {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name]
