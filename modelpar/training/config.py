"""The recipe schema: one dataclass per Hydra config group, validated before any rank starts.

Hydra merges ``recipes/`` YAML and command-line overrides into these typed nodes, so an unknown key or a
value of the wrong type is rejected by OmegaConf with the key's full path. ``validate`` then checks what
types cannot express (the layout against the model, the batch against micro-batches, ...), one line each.
"""

from __future__ import annotations

import importlib.resources
import math
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from modelpar.backends.gloo_cpu import AFFINITY_MODES, COLLECTIVE_ALGORITHMS, GLOO_THREAD_MODES
from modelpar.model.activations import RECOMPUTE, RECOMPUTE_MODULES
from modelpar.model.config import ModelConfig, ModelConfigError
from modelpar.optim import ZERO_STAGES
from modelpar.optim.muon import ADJUST_LR, DEFAULT_ADAMW_FOR, NS_DTYPES
from modelpar.parallel.context import CP_COMMS
from modelpar.parallel.layout import LayoutError, ParallelLayout
from modelpar.pipeline.schedule import SCHEDULES, V_SCHEDULES
from modelpar.training.outliers import OUTLIER_ACTIONS
from modelpar.training.ranges import out_of_range
from modelpar.training.sdc import SDC_ACTIONS

# the shipped recipes: recipes/ in a checkout, the package data `modelpar_recipes` in an installed wheel
RECIPES = str(importlib.resources.files("modelpar_recipes"))


class RecipeError(ValueError):
    """An invalid recipe; the message is one line naming the key, the problem and a fix."""


DTYPES = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
GUARD_ACTIONS = ("skip", "halt")
DRIFT_ACTIONS = ("warn", "halt")
FILE_ACCESS = {"group": 0o027, "owner": 0o077}  # trainer.files -> the process umask: never readable by others
PARTITIONS = ("flops", "blocks", "uniform", "params", "explicit")


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    sp: bool = False
    # sp: each column-parallel linear keeps its input's 1/tp sequence shard for backward and all-gathers it
    # again there (Megatron's), instead of keeping the gathered input (tp x the bytes, one all-gather fewer)
    sp_keep_shard: bool = True
    schedule: str = "1f1b"
    microbatches: int = 1
    # flops: balance half blocks (attention | MLP) against the head; blocks: the same in whole blocks;
    # uniform: even layer counts; params: balance parameters; explicit: stage_layers
    partition: str = "flops"
    stage_layers: list[float] = field(default_factory=list)  # layers per chunk (4 or 4.5) when partition=explicit
    collectives: str = "auto"  # auto | native | exchange (modelpar.backends.gloo_cpu)
    recompute: str = "none"  # none | selective | full (keep only each block's input, rerun it in backward)
    # with recompute=selective, what is rerun: attention | mlp (that half of each block) | elementwise (all but
    # matmul and attention outputs); modelpar/model/activations.py
    recompute_modules: list[str] = field(default_factory=lambda: ["elementwise"])
    offload_activations: bool = False  # saved activations of the blocks wait for backward in host memory
    cp: int = 1  # context parallel: each sequence split over cp ranks (2 of 2*cp chunks each, load-balanced)
    # ring: K/V blocks passed around the cp ring, overlapped | allgather: K/V gathered | alltoall: heads exchanged
    # (Ulysses) | hybrid: all-to-all inside groups of cp_a2a consecutive cp ranks, ring across them
    cp_comm: str = "ring"
    cp_a2a: int = 0  # hybrid: the all-to-all group size, a divisor of cp (cp: plain alltoall, 1: plain ring)
    ep: int = 1  # expert parallel: the experts split over ep of the dp x cp ranks (modelpar/parallel/experts.py)
    etp: int = 1  # expert tensor parallel: only 1 (experts are replicated over tp, tokens split over it)
    # schedule=dualpipev: run each overlapped forward/backward pair at once, one micro-batch computing while the
    # other's all-to-all or tp all-reduce is in flight (modelpar/parallel/handoff.py); under ZeRO-3 (and ZeRO-2
    # reducing every micro-batch) only the pairs through the rank's two different chunks
    overlap_pairs: bool = True

    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, vpp=self.vpp, cp=self.cp, ep=self.ep)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    zero: int = 0
    bucket_mb: float = 25.0
    # ZeRO-2/3 with trainer.dtype=bf16: the dtype gradients are reduce-scattered in (weights gather in bf16)
    reduce_dtype: str = "fp32"  # fp32 | bf16
    # ZeRO-2/3: shard over blocks of this many consecutive dp x cp ranks, replicate across them (0: all of dp x cp)
    zero_group: int = 0
    # ZeRO-2/3: reduce-scatter gradients after every micro-batch (less memory, m x the traffic) instead of once
    reduce_every_micro_batch: bool = False
    # muon: Muon for the hidden 2-D matrices, AdamW for the rest (modelpar/optim/muon.py, docs/optimizers.md)
    name: str = "adamw"  # adamw | muon
    muon_lr_scale: float = 1.0  # Muon's learning rate over optim.lr (the schedule scales both)
    muon_weight_decay: float = -1.0  # < 0: optim.weight_decay
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw | original (torch.optim.Muon's adjust_lr_fn)
    muon_ns_dtype: str = "bf16"  # Newton-Schulz's dtype: bf16 (torch.optim.Muon's) | fp32
    muon_per_head: bool = False  # q_proj, k_proj, v_proj orthogonalised per head (each head's rows alone)
    # logical tensors (fnmatch patterns) kept on AdamW although 2-D: the embedding, the head, MoE routers
    muon_adamw_for: list[str] = field(default_factory=lambda: list(DEFAULT_ADAMW_FOR))
    # QK-clip (MuonClip): > 0 rescales q/k of a head whose largest logit passed it (modelpar/training/qk_clip.py)
    qk_clip: float = 0.0


@dataclass
class BlendEntry:
    path: str = ""  # a token file or shard directory
    weight: float = 1.0  # its share of the windows drawn (weights need not sum to 1)


@dataclass
class DataConfig:
    # a .npy of uint16/uint32 token ids or a shard directory (modelpar-data prepare --output DIR); empty: the
    # default corpus (Python's stdlib source) unless data.blend lists datasets
    path: str = ""
    val_path: str = ""  # empty: the held-out split prepared with the data (DIR/val), else data.path itself
    blend: list[BlendEntry] = field(default_factory=list)  # [{path: a, weight: 0.7}, {path: b, weight: 0.3}]
    seq_len: int = 128
    global_batch: int = 16
    seed: int = 1234
    corpus_max_bytes: int = 4_000_000
    cache_dir: str = "data/cache"
    allow_changed: bool = False  # resume on a data file other than the checkpoint's (its fingerprint differs)
    document_mask: bool = False  # a token attends only to earlier tokens of its own document (packed windows)
    eos_id: int = -1  # the id that ends a document; -1: the token file's tokenizer's (modelpar-data prepare)


@dataclass
class TrainerConfig:
    steps: int = 100
    seed: int = 0
    out_dir: str = "runs/default"
    log_every: int = 1
    ckpt_every: int = 50
    ckpt_async: bool = False  # snapshot to host memory at a save step; a background thread writes the files
    keep_last: int = 2
    resume: str = "auto"  # auto | never | PATH of a checkpoint (a step directory, or a root's latest)
    # a fresh run (step 0, new optimizer) from a checkpoint's or an HF directory's weights and model identity,
    # until the run has a checkpoint of its own (modelpar/training/init_from.py)
    init_from: str = ""
    max_restarts: int = 0  # a failed local job starts again from the newest verified checkpoint, up to N times
    restart_backoff_s: float = 1.0  # wait before the first restart, doubling per restart (at most 60 s)
    # run (and resume) on the world now available: dp re-chosen, tp/pp/cp kept, the checkpoint resharded
    # (modelpar/training/elastic.py); needs no restart to apply, e.g. under torchrun with another world size
    elastic: bool = False
    world: int = 0  # ranks a local job may spawn (0: the layout's world); another value needs trainer.elastic
    files: str = "group"  # who may read run directories, checkpoints, flight records: group (and owner) | owner
    signing_key: str = ""  # a key file (modelpar-ckpt keygen): checkpoints signed, unsigned ones refused
    # a secret file (modelpar-ckpt keygen) every rank must prove it holds before the job starts (MODELPAR_JOB_SECRET
    # names one too); never the secret itself: modelpar/parallel/admission.py
    job_secret: str = ""
    timeout_s: float = 300.0
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    threads_per_rank: int = 1
    cpu_affinity: str = "auto"  # auto: bind each CPU rank to its own cores (modelpar.backends.gloo_cpu) | off
    # normal | idle: the tp group's gloo socket threads yield the core to compute; faster only on a machine the job has
    # to itself, many times slower beside any other busy process (docs/cpu.md)
    gloo_threads: str = "normal"
    sample_tokens: int = 64
    progress: bool = True
    peak_tflops: float = 0.0  # per rank, for MFU; 0: a CPU estimate is not reported
    nonfinite: str = "skip"  # a NaN/Inf loss or gradient norm: skip the step on every rank, or halt
    spike_factor: float = 0.0  # > 0: a loss above this factor x the recent mean is a spike
    spike_action: str = "skip"  # skip | halt
    check_every: int = 25  # steps between replica-drift and straggler checks (0: never)
    drift_action: str = "warn"  # warn | halt
    straggler_factor: float = 2.0  # a rank whose compute time exceeds this x the median is named
    # a dp replica whose gradient disagrees with the others' (training/outliers.py; dp >= 3 names it, dp2 only warns)
    grad_outlier_action: str = "warn"  # off | warn | skip | halt
    grad_outlier_cosine: float = 0.5  # named when its cosine to the others' mean is < 0 and this far below the median
    grad_outlier_norm: float = 10.0  # named above this x the median replica's gradient norm
    # silent data corruption: every N steps rerun the first micro-batch and compare bit for bit (0: never)
    sdc_check_every: int = 0
    sdc_action: str = "halt"  # a mismatch: halt | skip (the step's update) | warn
    save_error: str = "continue"  # a checkpoint save that fails (disk full, I/O error): continue | halt
    timeline_step: int = 0  # > 0: draw the pipeline timeline of this step to <out_dir>/timeline.png
    tensorboard: bool = False  # also write scalars to <out_dir>/tensorboard (needs the tensorboard package)
    wandb: bool = False  # also log to Weights & Biases (extra [wandb]); offline into <out_dir>/wandb without a network
    wandb_project: str = "modelpar"
    profile_steps: list[int] = field(default_factory=list)  # [a, b]: a torch.profiler trace per rank of steps a..b
    memory_snapshot: bool = False  # with profile_steps on CUDA: also a CUDA memory snapshot per rank
    # build and step this layout's rank roles on the meta device at the real world size, beside the planner
    dry_run: bool = False
    dry_run_ranks: str = "roles"  # roles (first, middle, last stage; a tp, cp, ep rank of each) | all


@dataclass
class EvalConfig:
    checkpoint: str = ""
    windows: int = 32


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def register_schema() -> None:
    """Register the schema with Hydra's ConfigStore (recipes list it first in their defaults)."""
    ConfigStore.instance().store(name="modelpar_schema", node=TrainConfig)


def validate(cfg: TrainConfig) -> ParallelLayout:
    """Check what types cannot: raises ``RecipeError``/``LayoutError`` with one line. Returns the layout."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    _check_choices(cfg)
    try:
        m.check()  # the model's own constraints, next to the model
    except ModelConfigError as exc:
        raise RecipeError(str(exc)) from None
    for key, value in (
        ("data.seq_len", d.seq_len),
        ("data.global_batch", d.global_batch),
        ("parallel.microbatches", p.microbatches),
        ("trainer.steps", cfg.trainer.steps),
    ):
        if value < 1:
            raise RecipeError(f"{key}={value} must be >= 1")
    if d.seq_len > m.max_seq_len:
        raise RecipeError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if cfg.optim.zero >= 2:  # FSDP2 (modelpar/optim/fsdp.py): what it is not combined with, in one line each
        z = f"optim.zero={cfg.optim.zero}"
        if cfg.trainer.sdc_check_every:
            raise RecipeError(
                f"{z} with trainer.sdc_check_every is not supported (the rerun needs unreduced "
                "gradients); set trainer.sdc_check_every=0 or optim.zero<=1"
            )
        if m.compile:
            raise RecipeError(f"{z} with model.compile=true is untested; set model.compile=false")
    g, dpcp = cfg.optim.zero_group, p.dp * p.cp
    if g and (cfg.optim.zero < 2 or g < 0 or dpcp % g):
        fits = [d for d in range(1, dpcp + 1) if dpcp % d == 0]
        raise RecipeError(
            f"optim.zero_group={g} needs optim.zero=2 or 3 and a divisor of dp x cp = {dpcp} ({fits}); "
            "0 shards over all of dp x cp"
        )
    if cfg.optim.qk_clip:  # modelpar/training/qk_clip.py: what it is not combined with
        if m.qk_norm:
            raise RecipeError(
                f"optim.qk_clip={cfg.optim.qk_clip} is not supported with model.qk_norm=true (the norms undo a scale "
                "of the projections); set model.qk_norm=false"
            )
    if cfg.optim.muon_per_head and m.mla.enabled:
        raise RecipeError("optim.muon_per_head=true is for q/k/v heads, not latent attention; set it false")
    if cfg.optim.name == "muon" and g:
        raise RecipeError(f"optim.name=muon with optim.zero_group={g} is not supported; use optim.zero_group=0")
    if p.recompute == "selective":
        unknown = [m for m in p.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown or not p.recompute_modules:
            raise RecipeError(
                f"parallel.recompute_modules={list(p.recompute_modules)} must list some of "
                f"{', '.join(RECOMPUTE_MODULES)} for parallel.recompute=selective"
            )
        if m.compile:
            raise RecipeError("parallel.recompute=selective with model.compile=true is untested; use one of them")
    if p.schedule in V_SCHEDULES and p.vpp != 2:
        raise RecipeError(f"parallel.schedule={p.schedule} folds two chunks per rank in a V; set parallel.vpp=2")
    if p.schedule in V_SCHEDULES and m.tie_embeddings and cfg.optim.zero >= 2:
        raise RecipeError(
            f"parallel.schedule={p.schedule} with tied embeddings at optim.zero={cfg.optim.zero} is not supported "
            "(rank 0 holds both ends of the V, one weight in two FSDP units); a tied model (Llama 3.2 1B/3B, Gemma) "
            f"trains at optim.zero={cfg.optim.zero} with parallel.schedule=zb-h1 or interleaved, or under "
            f"{p.schedule} at optim.zero=1"
        )
    if p.vpp > 1 and p.schedule not in ("interleaved", *V_SCHEDULES):
        raise RecipeError(
            f"parallel.vpp={p.vpp} needs parallel.schedule=interleaved, zbv or dualpipev (got {p.schedule})"
        )
    if p.schedule == "interleaved" and p.vpp < 2:
        raise RecipeError("parallel.schedule=interleaved needs parallel.vpp >= 2")
    if m.moe.enabled and (m.moe.experts % p.ep or (p.dp * p.cp) % p.ep):  # both rules in one hint
        raise RecipeError(
            f"parallel.ep={p.ep} must divide model.moe.experts={m.moe.experts} and dp x cp = {p.dp * p.cp}; try ep "
            f"in {m.expert_splits(p.dp * p.cp)}"
        )
    layout = p.layout()
    m.check_layout(layout)  # the layout's shape rules and the experts' split over ep
    if p.etp != 1:
        raise RecipeError(
            f"parallel.etp={p.etp}: expert tensor parallelism is not supported (experts are replicated over tp "
            "and the tokens split over it); set parallel.etp=1 and raise parallel.ep to divide expert memory"
        )
    moe = m.moe
    if moe.enabled and moe.aux_loss_coef and moe.aux_loss_scope == "global_batch":
        if p.microbatches > 1 and p.schedule != "gpipe":
            raise RecipeError(
                f"model.moe.aux_loss_scope=global_batch needs every micro-batch's forward before the first backward, "
                f"which parallel.schedule={p.schedule} at {p.microbatches} micro-batches does not do; use "
                "parallel.schedule=gpipe, parallel.microbatches=1, or model.moe.aux_loss_scope=micro_batch"
            )
    if m.mtp_depth and d.document_mask:
        raise RecipeError(
            f"model.mtp_depth={m.mtp_depth} with data.document_mask=true: the shifted tokens would cross documents; "
            "set data.document_mask=false or model.mtp_depth=0"
        )
    if p.ep > 1 and cfg.optim.zero_group and cfg.optim.zero_group != p.dp * p.cp:
        raise RecipeError(
            f"optim.zero_group={cfg.optim.zero_group} with parallel.ep={p.ep} is not supported (the experts shard "
            "over the ranks holding the same experts, not in blocks); use optim.zero_group=0"
        )
    if p.cp > 1 and d.seq_len % (2 * p.cp):
        fits = [c for c in range(1, d.seq_len // 2 + 1) if d.seq_len % (2 * c) == 0]
        raise RecipeError(
            f"parallel.cp={p.cp} needs data.seq_len={d.seq_len} divisible by 2*cp={2 * p.cp} (each cp rank holds "
            f"2 of 2*cp chunks); try cp in {fits[:8]} or data.seq_len={-(-d.seq_len // (2 * p.cp)) * 2 * p.cp}"
        )
    if p.sp and p.tp > 1 and d.seq_len % (p.tp * p.cp):
        per_cp = f" / cp={p.cp} = {d.seq_len / p.cp:g} tokens per cp rank" if p.cp > 1 else ""
        raise RecipeError(f"parallel.sp=true needs data.seq_len={d.seq_len}{per_cp} divisible by parallel.tp={p.tp}")
    _check_head_exchange(p, m)
    if p.cp > 1 and m.compile:
        raise RecipeError(
            f"parallel.cp={p.cp} with model.compile=true is not supported (the ring attention is not traced); "
            "set model.compile=false or parallel.cp=1"
        )
    if m.fp8 != "off" and m.compile:
        raise RecipeError(f"model.fp8={m.fp8} with model.compile=true is untested; set model.compile=false")
    if d.document_mask and m.compile:
        raise RecipeError("data.document_mask=true with model.compile=true is not supported; set model.compile=false")
    if d.eos_id >= m.vocab_size:
        raise RecipeError(f"data.eos_id={d.eos_id} is not a token id of model.vocab_size={m.vocab_size}")
    if d.global_batch % p.dp:
        step = p.dp * p.microbatches  # each replica's share must split into the micro-batches too
        up = -(-d.global_batch // step) * step
        raise RecipeError(
            f"data.global_batch={d.global_batch} is not divisible by parallel.dp={p.dp}; try data.global_batch={up} "
            f"(a multiple of parallel.dp x parallel.microbatches = {step})"
        )
    per_replica = d.global_batch // p.dp
    if per_replica % p.microbatches:
        raise RecipeError(
            f"parallel.microbatches={p.microbatches} does not divide the {per_replica} sequences per dp replica "
            f"(data.global_batch={d.global_batch} / dp={p.dp}); try microbatches in "
            f"{[k for k in range(1, per_replica + 1) if per_replica % k == 0]}"
        )
    if p.partition == "explicit" and (
        len(p.stage_layers) != p.pp * p.vpp
        or sum(p.stage_layers) != m.layers
        or any(c < 0 or (2 * c) % 1 for c in p.stage_layers)
    ):
        raise RecipeError(
            f"parallel.stage_layers={list(p.stage_layers)} must list pp*vpp={p.pp * p.vpp} whole or half (e.g. 4.5) "
            f"counts >= 0 summing to model.layers={m.layers}"
        )
    _check_blend(d)
    _check_profile(cfg.trainer)
    if cfg.trainer.timeout_s <= 0:
        raise RecipeError(f"trainer.timeout_s={cfg.trainer.timeout_s} must be > 0 (seconds before a stuck rank fails)")
    problem = out_of_range(cfg)
    if problem:
        raise RecipeError(problem)
    return layout


# Every option that takes one of a few values, in one place: where the values come from, and the recipe key.
# (str fields rather than Enums so that a bad value gets this module's one-line message, not Hydra's.)
SAVE_ERROR_ACTIONS = ("continue", "halt")
CHOICES: dict[str, tuple] = {
    "parallel.schedule": tuple(SCHEDULES),
    "parallel.collectives": COLLECTIVE_ALGORITHMS,
    "parallel.recompute": RECOMPUTE,
    "parallel.partition": PARTITIONS,
    "parallel.cp_comm": CP_COMMS,
    "optim.zero": ZERO_STAGES,
    "optim.reduce_dtype": ("fp32", "bf16"),
    "optim.name": ("adamw", "muon"),
    "optim.muon_adjust_lr": ADJUST_LR,
    "optim.muon_ns_dtype": tuple(NS_DTYPES),
    "trainer.cpu_affinity": AFFINITY_MODES,
    "trainer.gloo_threads": GLOO_THREAD_MODES,
    "trainer.dtype": DTYPES,
    "trainer.device": DEVICES,
    "trainer.nonfinite": GUARD_ACTIONS,
    "trainer.spike_action": GUARD_ACTIONS,
    "trainer.drift_action": DRIFT_ACTIONS,
    "trainer.files": FILE_ACCESS,
    "trainer.grad_outlier_action": OUTLIER_ACTIONS,
    "trainer.sdc_action": SDC_ACTIONS,
    "trainer.save_error": SAVE_ERROR_ACTIONS,
}
_UNKNOWN = ("parallel.schedule", "parallel.collectives")  # registries: "unknown" rather than "must be"


def _check_choices(cfg: TrainConfig) -> None:
    for key, allowed in CHOICES.items():
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if value not in allowed:
            listed = ", ".join(map(str, allowed))
            verb = "is unknown; choose one of" if key in _UNKNOWN else "must be one of"
            raise RecipeError(f"{key}={value!r} {verb} {listed}")
    if cfg.trainer.init_from and cfg.trainer.resume not in ("auto", "never"):
        raise RecipeError(
            f"trainer.init_from={cfg.trainer.init_from} and trainer.resume={cfg.trainer.resume} both name weights to "
            "start from; keep one (init_from starts a fresh run, resume continues one)"
        )
    if cfg.trainer.max_restarts > 0 and cfg.trainer.resume != "auto":
        raise RecipeError(
            f"trainer.max_restarts={cfg.trainer.max_restarts} restarts from the newest verified checkpoint of the run, "
            f"which trainer.resume={cfg.trainer.resume!r} does not read; use trainer.resume=auto"
        )


def _check_head_exchange(p: ParallelConfig, m: ModelConfig) -> None:
    """alltoall / hybrid: the all-to-all group splits the query heads of each tp rank."""
    fits = [n for n in range(1, p.cp + 1) if p.cp % n == 0]
    if p.cp_comm != "hybrid" and p.cp_a2a:
        raise RecipeError(f"parallel.cp_a2a={p.cp_a2a} applies only to parallel.cp_comm=hybrid; set parallel.cp_a2a=0")
    if p.cp_comm == "hybrid" and (p.cp_a2a < 1 or p.cp % p.cp_a2a):
        raise RecipeError(
            f"parallel.cp_comm=hybrid needs parallel.cp_a2a (the all-to-all group size) dividing parallel.cp={p.cp}, "
            f"got {p.cp_a2a}; try cp_a2a in {fits}"
        )
    n = p.cp if p.cp_comm == "alltoall" else p.cp_a2a if p.cp_comm == "hybrid" else 1
    if n > 1 and m.mla.enabled:
        raise RecipeError(
            f"parallel.cp_comm={p.cp_comm} exchanges heads; latent attention (model.mla) sends its shared latent "
            "instead: use parallel.cp_comm=ring or allgather"
        )
    heads = m.heads // p.tp
    if n > 1 and heads % n:
        ok = [d for d in fits if heads % d == 0]
        raise RecipeError(
            f"parallel.cp_comm={p.cp_comm} splits the {heads} query heads per tp rank (model.heads={m.heads} / "
            f"tp={p.tp}) over an all-to-all of {n} cp ranks, which does not divide them; use parallel.cp_comm=hybrid "
            f"with parallel.cp_a2a in {ok}, or parallel.cp_comm=ring"
        )


def _check_blend(d: DataConfig) -> None:
    if not d.blend:
        return
    if d.path:
        raise RecipeError(f"data.path={d.path!r} and data.blend are both set; give the datasets in data.blend only")
    for i, entry in enumerate(d.blend):
        if not entry.path:
            raise RecipeError(f"data.blend[{i}].path is empty; name a token file or shard directory")
        if not math.isfinite(entry.weight) or entry.weight < 0:
            raise RecipeError(f"data.blend[{i}].weight={entry.weight} must be a finite number >= 0")
    if sum(entry.weight for entry in d.blend) <= 0:
        raise RecipeError("data.blend weights sum to 0; give at least one dataset a positive weight")


def _check_profile(t: TrainerConfig) -> None:
    steps = list(t.profile_steps)
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= t.steps):
        raise RecipeError(
            f"trainer.profile_steps={steps} must be [first, last] with 1 <= first <= last <= trainer.steps={t.steps}"
        )
    if t.memory_snapshot and not steps:
        raise RecipeError("trainer.memory_snapshot=true needs trainer.profile_steps=[first, last] (the steps recorded)")


__all__ = ["LayoutError", "RecipeError", "TrainConfig", "register_schema", "validate"]
