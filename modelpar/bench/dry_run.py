"""Dry run: one rank of a real-size job, built and stepped on the meta device, beside the planner.

    modelpar-train --config-name llama-8b-64gpu trainer.dry_run=true

For each distinct rank role of the recipe's layout (``rank_roles``: the first, a middle and the last pipeline
stage, the stage the planner finds fullest, and on each a tp, cp and ep rank other than 0;
``trainer.dry_run_ranks=all``: every rank) this builds that rank through the trainer's own functions
(``build_rank_model``, ``build_runtime``, ``build_rank_optimizer``, ``TrainStep``) on the meta device under
the fake process group at the recipe's real world size (``modelpar.bench.meta_world``), runs one training
step of the real schedule, and reports:

- parameter, gradient and optimizer-state bytes, from the tensors at the optimizer step (``StateProbe``);
- peak saved activations over the step's in-flight micro-batches (``SavedTensorMeter``);
- bytes per collective kind per process group, counted at the c10d ops (``MetaStep``);

each beside the planner's prediction for the same layout and pipeline stage (``modelpar.plan``
for memory, ``modelpar.bench.dry_run_traffic`` for collective bytes). The step runs the torch reference
kernels (Triton kernels need a GPU), so the planner is asked for those too. Meta tensors hold no data: the loss
and gradient norm read back as 1 and routing is perfectly balanced (``meta_world``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

from modelpar.bench.dry_run_traffic import planned_traffic
from modelpar.bench.meta_world import CpuAttention, HostData, MetaStep, fake_world, fsdp_on_meta, group_names
from modelpar.bench.meters import GatheredMeter, SavedTensorMeter, StateProbe, trainer_state_bytes
from modelpar.bench.recipe_memory import recipe_strategy
from modelpar.parallel.groups import ParallelGroups
from modelpar.parallel.layout import ParallelLayout
from modelpar.plan.activations import stage_activations
from modelpar.plan.memory import fullest_stage
from modelpar.plan.presets import HARDWARE
from modelpar.plan.saved import activation_bytes
from modelpar.plan.spec import ModelSpec
from modelpar.plan.states import state_bytes
from modelpar.training.build import build_rank_model, build_rank_optimizer, build_runtime
from modelpar.training.config import TrainConfig
from modelpar.training.health import LossGuard
from modelpar.training.step import TrainStep

GIB = 2**30
TOLERANCE = 0.05  # activations and collective bytes within 5% of the planner; model states exact
JUDGED_SHARE = 0.005
STATE_KINDS = ("weights", "gradients", "optimizer", "buffers")
H100_BF16 = dataclasses.replace(HARDWARE["h100-80gb"], dtype="bf16")  # what ``fits`` judges: the recipe's GPU step


@dataclass
class RankReport:
    """What one rank holds and sends in one step, measured and predicted (bytes)."""

    rank: int
    role: str
    stage: int
    states: dict[str, int]
    planned_states: dict[str, float]
    activations: int
    planned_activations: float
    traffic: dict[str, int]  # "group kind" -> bytes
    planned_traffic: dict[str, float]
    blind_reads: int = 0
    planned_activations_bf16: float = 0.0
    planned_gathered_bf16: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def memory_rel_err(self) -> float:
        errs = [_rel(self.states[k], self.planned_states.get(k, 0.0)) for k in self.states]
        return max([*errs, _rel(self.activations, self.planned_activations)])

    @property
    def states_exact(self) -> bool:
        return all(self.states[k] == self.planned_states.get(k, 0.0) for k in self.states)

    @property
    def comm_rel_err(self) -> float:
        return max((_rel(self.traffic.get(k, 0), self.planned_traffic.get(k, 0.0)) for k in self.judged), default=0.0)

    @property
    def judged(self) -> list[str]:
        """The collectives held to the tolerance: those carrying at least ``JUDGED_SHARE`` of the rank's bytes
        (a loss's 8-byte all-reduce, which the planner does not price, is listed but not judged)."""
        total = sum(self.traffic.values())
        keys = set(self.traffic) | set(self.planned_traffic)
        return sorted(
            k for k in keys if max(self.traffic.get(k, 0), self.planned_traffic.get(k, 0.0)) >= JUDGED_SHARE * total
        )

    @property
    def total_bf16(self) -> float:
        """Bytes of the recipe's bf16 step on a GPU: the measured model states (fp32 whatever the compute dtype),
        and the planner's bf16 figures for what this fp32 run on the CPU's kernels cannot show: FSDP2's gathered
        weights (bf16 there) with the unsharded gradients, and the activations the GPU's kernels save."""
        kept = sum(v for k, v in self.states.items() if k != "gathered")
        return kept + self.planned_gathered_bf16 + self.planned_activations_bf16


def _rel(measured: float, planned: float) -> float:
    if measured == planned:
        return 0.0
    return abs(planned - measured) / max(abs(measured), 1.0)


# -- which ranks -------------------------------------------------------------------------------------------------


def rank_roles(layout: ParallelLayout, every: bool = False, fullest: int | None = None) -> list[tuple[int, str]]:
    """(global rank, role) of each distinct role: pipeline stages first, middle and last (and ``fullest``, the
    stage the planner finds fullest, when it is another), and on each the ranks at tp, cp and ep coordinate 0
    and at the last one (the others are their mirror images)."""
    if every:
        return [(r, f"rank {r}") for r in range(layout.world_size)]
    stages = sorted({0, layout.pp // 2, layout.pp - 1} | ({fullest} if fullest is not None else set()))
    out: dict[int, str] = {}
    for pp in stages:
        where = {layout.pp // 2: "middle", layout.pp - 1: "last", 0: "first"}.get(pp, "fullest")  # later keys win
        out.setdefault(layout.rank(pp=pp), f"{where} stage")
        if layout.tp > 1:
            out.setdefault(layout.rank(pp=pp, tp=layout.tp - 1), f"{where} stage, tp {layout.tp - 1}")
        if layout.cp > 1:
            out.setdefault(layout.rank(pp=pp, cp=layout.cp - 1), f"{where} stage, cp {layout.cp - 1}")
        if layout.ep > 1:
            ep_last = layout.ep_ranks(layout.rank(pp=pp))[-1]
            out.setdefault(ep_last, f"{where} stage, ep {layout.ep - 1}")
    return sorted(out.items())


# -- one rank ----------------------------------------------------------------------------------------------------


class _MetaTokens:
    """The data a step reads, as meta tensors: this dp replica's share of the global batch."""

    path = ""

    def __init__(self, rows: int, seq_len: int):
        self.rows, self.seq_len = rows, seq_len

    def batch(self, _indices) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.rows, self.seq_len)
        return torch.empty(shape, dtype=torch.int64, device="meta"), torch.empty(
            shape, dtype=torch.int64, device="meta"
        )


class _Sampler:
    def next_batch(self):
        return None


def dry_run_config(cfg: TrainConfig) -> TrainConfig:
    """The recipe as the dry run steps it: torch kernels (Triton needs a GPU), no compile, fp32 compute
    (``torch.autocast`` has no meta device), no health plug-ins that compare replicas, and an EOS id for
    document masks (id 0, no tokenizer)."""
    model = dataclasses.replace(cfg.model, kernels="torch", compile=False)
    trainer = dataclasses.replace(
        cfg.trainer,
        dtype="fp32",  # autocast has no meta device: activations and exchanges in fp32, beside the fp32 planner
        grad_outlier_action="off",
        sdc_check_every=0,
    )
    data = cfg.data
    if data.document_mask and data.eos_id < 0:
        data = dataclasses.replace(data, eos_id=0)
    return dataclasses.replace(cfg, model=model, trainer=trainer, data=data)


def step_rank(cfg: TrainConfig, rank: int, role: str = "") -> RankReport:
    """Build rank ``rank`` of ``cfg`` on the meta device, run one step, and put the planner beside it."""
    cfg = dry_run_config(cfg)
    layout = cfg.parallel.layout()
    device, dtype = torch.device("meta"), torch.bfloat16 if cfg.trainer.dtype == "bf16" else torch.float32
    with fake_world(rank, layout.world_size), fsdp_on_meta():
        groups = ParallelGroups.build(layout)
        mode = MetaStep(group_names(groups))
        with mode:
            with HostData(mode):  # the build only: the step makes no host data that matters
                torch.manual_seed(cfg.trainer.seed)
                model = build_rank_model(cfg, groups, device)
                runtime = build_runtime(cfg, model, groups, device, dtype)
                optimizer = build_rank_optimizer(cfg, model, groups)
            for hook in ("before_backward", "before_weight_backward", "after_weight_backward"):  # FSDP2's
                setattr(runtime, hook, getattr(optimizer, hook, None))
            t = cfg.trainer
            step = TrainStep(
                cfg=cfg,
                groups=groups,
                model=model,
                runtime=runtime,
                optimizer=optimizer,
                tokens=_MetaTokens(cfg.data.global_batch // layout.dp, cfg.data.seq_len),
                sampler=_Sampler(),
                device=device,
                dtype=dtype,
                guard=LossGuard(t.nonfinite, t.spike_factor, t.spike_action),
                flops_per_step=0.0,
            )
            params = [p for p, _ in model.params]
            gathered = GatheredMeter(model.chunks)
            meter = SavedTensorMeter(exclude=params, gathered=gathered if gathered else None)
            probe = StateProbe(_Owner(model, optimizer))
            mode.reset_counts()
            blind = mode.blind_reads
            with meter, CpuAttention():
                step(0)
            probe.remove()
            after = trainer_state_bytes(_Owner(model, optimizer))  # the moments exist once the first step ran
        states = {k: int((probe.bytes or {}).get(k, 0)) for k in STATE_KINDS}
        states["optimizer"] = int(after["optimizer"])
        states["gathered"] = int(gathered.peak)
        traffic = {f"{g} {k}": b for (g, k), b in sorted(mode.bytes.items())}
        stage = groups.pp_rank
        report = RankReport(
            rank=rank,
            role=role,
            stage=stage,
            states=states,
            planned_states={},
            activations=int(meter.peak),
            planned_activations=0.0,
            traffic=traffic,
            planned_traffic={},
            blind_reads=mode.blind_reads - blind,
        )
    return _with_plan(cfg, report)


@dataclass
class _Owner:
    """What ``StateProbe`` reads of a trainer."""

    model: object
    optimizer: object


def _with_plan(cfg: TrainConfig, report: RankReport) -> RankReport:
    """The planner's memory and collective bytes for the report's pipeline stage, torch kernels, bf16 or fp32."""
    hardware = dataclasses.replace(HARDWARE["h100-80gb"], kernels="torch", dtype=cfg.trainer.dtype)
    strategy = recipe_strategy(cfg)
    model = ModelSpec(cfg.model)
    seq = cfg.data.seq_len
    states = state_bytes(model, strategy, seq, report.stage, activation_bytes(hardware))
    act = stage_activations(model, strategy, seq, hardware, report.stage)
    report.planned_states = {k: float(states.get("gradients" if k == "gradients" else k, 0.0)) for k in STATE_KINDS}
    report.planned_states["gathered"] = float(states.get("gathered", 0.0))
    report.planned_activations = act.device
    # what the recipe's bf16 step keeps on a GPU, for ``fits``: the GPU preset resolves model.kernels=auto
    report.planned_activations_bf16 = stage_activations(model, strategy, seq, H100_BF16, report.stage).device
    bf16_states = state_bytes(model, strategy, seq, report.stage, activation_bytes(H100_BF16))
    report.planned_gathered_bf16 = float(bf16_states.get("gathered", 0.0))
    report.planned_traffic = planned_traffic(model, strategy, seq, hardware, report.stage)
    return report


# -- the whole run -----------------------------------------------------------------------------------------------


def dry_run(cfg: TrainConfig, *, preset: str = "", every: bool = False, print_fn=print) -> dict:
    """Step each rank role of ``cfg`` (``rank_roles``); print a table per rank and return the summary."""
    layout = cfg.parallel.layout()
    fullest = None if every else fullest_stage(ModelSpec(cfg.model), recipe_strategy(cfg), cfg.data.seq_len, H100_BF16)
    reports = []
    for rank, role in rank_roles(layout, every, fullest):
        report = step_rank(cfg, rank, role)
        reports.append(report)
        for line in format_report(report):
            print_fn(line)
    hardware_bytes = HARDWARE["h100-80gb"].memory_bytes
    reserved = HARDWARE["h100-80gb"].reserved_bytes
    summary = {
        "preset": preset or cfg.model.name,
        "world": layout.world_size,
        "ranks_checked": len(reports),
        "worst_memory_rel_err": round(max(r.memory_rel_err for r in reports), 5),
        "worst_comm_rel_err": round(max(r.comm_rel_err for r in reports), 5),
        "fits": all(r.total_bf16 + reserved <= hardware_bytes for r in reports),
    }
    ranks = [
        dataclasses.asdict(r) | {"judged": r.judged, "memory_rel_err": r.memory_rel_err, "comm_rel_err": r.comm_rel_err}
        for r in reports
    ]
    return {"summary": summary, "ranks": ranks}


def format_report(r: RankReport) -> list[str]:
    """One rank's figures beside the planner's, GiB for memory and MiB for collectives."""
    lines = [f"rank {r.rank} ({r.role}, pipeline stage {r.stage})          measured     planner   rel err"]
    for k, v in r.states.items():
        p = r.planned_states.get(k, 0.0)
        lines.append(f"  {k:<34} {v / GIB:10.3f} {p / GIB:10.3f} GiB  {_rel(v, p):7.2%}")
    p = r.planned_activations
    lines.append(
        f"  {'activations (saved, peak)':<34} {r.activations / GIB:10.3f} {p / GIB:10.3f} GiB  "
        f"{_rel(r.activations, p):7.2%}"
    )
    lines.append(
        f"  {'total of the bf16 step on a GPU':<34} {r.total_bf16 / GIB:10.3f} {'':>10} GiB  (fits judges this; the "
        "rows above are this fp32 CPU run's)"
    )
    judged, unjudged = set(r.judged), []
    for k in sorted(set(r.traffic) | set(r.planned_traffic)):
        v, p = r.traffic.get(k, 0), r.planned_traffic.get(k, 0.0)
        err = f"{_rel(v, p):7.2%}" if k in judged else f"{'-':>7}"
        unjudged += [] if k in judged else [k]
        lines.append(f"  {k:<34} {v / 2**20:10.1f} {p / 2**20:10.1f} MiB  {err}")
    if unjudged:
        lines.append(
            f"  -: under {JUDGED_SHARE:.1%} of this rank's collective bytes (a loss's or a flag's few bytes, which "
            "the planner does not price): listed, not judged"
        )
    return lines


def summary_line(result: dict) -> str:
    return json.dumps(result["summary"])
