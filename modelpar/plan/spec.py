"""What the planner reads and what it answers: the model, the hardware, the calibration knobs, one strategy
(layout, micro-batching, recompute, offload, ZeRO, SP), and the per-rank memory and per-step time it predicts.

The per-rank prediction a caller compares with a real rank (``modelpar.plan.rank``) is built from these:
``MemoryBreakdown`` (bytes per state kind and activations) and ``Prediction`` (seconds per component).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from modelpar.model.config import ModelConfig
from modelpar.parallel.layout import ParallelLayout
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.schedule import SCHEDULES, V_SCHEDULES, placement_for

GIB = 2**30
RECOMPUTE_MODES = ("none", "selective", "full")
# parallel.recompute_modules the planner tries: the cheap ops, either half, either half plus the other's cheap ops
SELECTIVE_CHOICES = (("elementwise",), ("attention",), ("mlp",), ("attention", "elementwise"), ("mlp", "elementwise"))


class PlanError(ValueError):
    """Impossible planning inputs or no answer; the message is one line naming the problem and a fix."""


# -- inputs --------------------------------------------------------------------------------------------------


BLOCKS = ("llama", "gpt")


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs of a model: its shape (matmul sizes, and whether the head shares the embedding),
    whether attention runs as a fused (flash) kernel that never stores the ``s x s`` scores (the GPT block's
    term; our block never stores them), and which block and engine the memory model describes: ``llama``,
    modelpar's own (``modelpar.plan.activations``: its saved tensors one by one, fp32 parameters and moments)
    or ``gpt``, Megatron-LM's GPT block and engine (Korthikanti et al. 2022's activations, bf16 weights with
    fp32 masters), for the published runs (``modelpar.plan.published``)."""

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
    fp8_peak_flops: float = 0.0  # dense FP8 FLOP/s (model.fp8 GEMMs); 0: no FP8 units, they run at peak_flops
    fp32_peak_flops: float = 0.0  # dense fp32 FLOP/s without tensor cores (TF32 off, torch's default): the
    #   plain-matmul attention of a soft-cap or sinks (``modelpar.plan.unfused``); 0: peak_flops

    @property
    def weight_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    @property
    def optimizer_bytes(self) -> int:
        """Per parameter: fp32 master (bf16 only) and the two fp32 Adam moments."""
        return 12 if self.dtype == "bf16" else 8


GRAD_BYTES = 4  # gradients are accumulated and reduced in fp32 in both dtypes


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
    sharding, ``optim.zero_group``) and ``stage_layers`` (the chunks' layer counts; empty: the trainer's default
    split). ``pipeline`` is ``parallel.schedule`` where it is not the one the layout implies (1F1B, interleaved
    with ``vpp > 1``): ``zbv`` or ``dualpipev`` (``vpp = 2``, chunks placed in a V), ``zb-h1``, ``gpipe``; the
    search tries the V ones (``SearchSpace.schedules``). ``reduce_every_micro_batch``
    (ZeRO-2/3: no unsharded gradients kept across micro-batches, m reduce-scatters) the search tries, like
    offload, where a strategy does not fit without it."""

    layout: ParallelLayout
    micro_batch_size: int
    micro_batches: int
    recompute: str = "none"  # none | selective | full
    zero: int = 0  # optim.zero: 1 shards the optimizer state over dp x cp, 2 also gradients, 3 also weights
    sp: bool = False
    cp_comm: str = "ring"  # ring | allgather | alltoall, when layout.cp > 1
    recompute_modules: tuple[str, ...] = ("elementwise",)
    offload: bool = False  # parallel.offload_activations
    zero_group: int = 0
    stage_layers: tuple[float, ...] = ()
    pipeline: str = ""
    reduce_every_micro_batch: bool = False
    optimizer: str = "adamw"  # optim.name: muon keeps one momentum buffer (not two moments) for hidden matrices
    # parallel.sp_keep_shard: under SP the column-parallel linears of the halves not rerun keep their input's
    # 1/t shard for backward and all-gather it again there (False: they keep the gathered input)
    sp_keep_shard: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero", int(self.zero))  # True/False from older callers: stage 1 / 0
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        if self.pipeline and self.pipeline not in SCHEDULES:
            raise PlanError(f"pipeline={self.pipeline!r} is no schedule; choose one of {', '.join(SCHEDULES)}")
        if self.pipeline in V_SCHEDULES and self.layout.vpp != 2:
            raise PlanError(f"pipeline={self.pipeline} folds two chunks per rank in a V; use vpp=2")

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
    def placement(self) -> Placement:
        """Which rank holds each model chunk: V for zbv and dualpipev (rank 0 holds the first and the last)."""
        return placement_for(self.schedule_name)

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
        flags += [self.pipeline] * bool(self.pipeline and self.layout.pp > 1)
        return f"{self.layout} {' '.join(flags)}"


# -- outputs -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one rank; ``stage`` names which pipeline stage (first, last, or ``stage r``) this is.

    ``weights``, ``grads``, ``optimizer`` and ``buffers`` (zero-0's has-gradient flags) are held at the optimizer
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
    optimizer_s: float = 0.0  # Muon's Newton-Schulz and exchange (modelpar.plan.optimizer_step); AdamW: 0

    @property
    def total_s(self) -> float:
        comm = self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.cp_comm_s + self.ep_comm_s
        return self.compute_s + comm + self.bubble_s + self.offload_s + self.optimizer_s

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
