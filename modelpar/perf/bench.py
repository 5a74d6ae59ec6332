"""modelpar-bench: layout benchmarks of the trainer's step, raced run by run against PyTorch's own parallelism.

    modelpar-bench                                     # recipes/bench.yaml: bench-tiny, the default sweep
    modelpar-bench bench.sweep='[tp2,pp2-1f1b]' bench.rounds=3
    modelpar-bench -m parallel=single,tp2,pp2,tp2-pp2  # one layout per Hydra job; the rows merge
    modelpar-bench bench.peak_tflops=989 trainer.device=cuda ...   # MFU against a GPU's peak

For each layout (a ``bench.sweep`` entry such as ``tp2-pp2-1f1b-m8``; or the recipe's ``parallel`` group when
the sweep is empty, in a multirun, or when ``parallel=`` is given without ``bench.sweep=``) the ranks
(``modelpar.testing.run_on_ranks``: local processes, gloo over loopback, one thread each) build our
``Trainer`` and the peer of the layout (``modelpar.perf.peers``) from the same weights and data, then
alternate: a warm-up step of each, one step of each with memory and communication meters on, then ``rounds`` x
(``steps_per_round`` of ours, ``steps_per_round`` of the peer), each step timed between barriers (the slowest
rank's time counts). With ``passes > 1`` the whole sweep repeats round-robin and the timed steps of all passes
pool (load from other jobs drifts over minutes). From the timed steps it reports

- tokens/s (median step), achieved TFLOP/s per rank and MFU against ``bench.peak_tflops`` per rank (0: a
  one-thread fp32 matmul measured here); FLOPs per token are ``modelpar.model.flops.training_flops_per_token``,
  6 N + 12 L h s (Kaplan et al. 2020; Chowdhery et al. 2022), model FLOPs without recomputation;
- each rank's CPU share (process CPU seconds over wall seconds: how much of a core it got while other jobs
  share the machine);
- the measured bubble (idle compute time over ranks x span, from the runtime's per-action records of the
  first pipeline) beside ``simulate`` of the schedule with the measured mean F/B(/W) durations, and with
  every action's own measured duration (the replay: stage imbalance included, runtime overhead not); and for
  pipelines the bubble-bound ideal ``single-rank tokens/s x ranks x m / (m + p - 1)`` when the sweep ran
  ``single`` too;
- peak activation memory per pipeline stage: the CUDA allocator's peak over the step on GPU, on CPU the
  most bytes held at once by tensors autograd saved for backward (``SavedTensorMeter``);
- communication bytes per step by kind (``modelpar.parallel.collectives.record_comm``, summed over ranks) plus the
  pipeline's p2p sends (activation bytes x SEND actions, which the runtime posts outside ``comm``);
- the peer's tokens/s, our ratio to it, and whether the first step's losses agree (relative 1e-5). The peer
  runs our layer split (``bench.peer_partition=same``), or with ``uniform`` the even split a user of
  ``torch.distributed.pipelining`` gets without a partitioner, named "(uniform split)" in the table.

Results accumulate in ``bench.results_dir`` (``benchmarks/results``): ``bench.json`` (one row per layout; a
rerun replaces its layout's row), ``bench.md``, ``bench_throughput.png`` and, per pipeline layout, the
measured timeline of one step, ``bench_timeline_<layout>.png``. The table is printed too.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from modelpar.model.flops import model_shape, training_flops_per_token
from modelpar.parallel.collectives import record_comm
from modelpar.parallel.layout import SCHEDULES
from modelpar.pipeline import Costs, Timeline, build_schedule, simulate
from modelpar.pipeline.actions import SEND_B, SEND_F
from modelpar.testing import run_on_ranks, shutdown_pools
from modelpar.training.config import RECIPES, ParallelConfig, TrainConfig, validate


@dataclass
class BenchOptions:
    sweep: list[str] = field(default_factory=list)  # layout specs (``parse_layout``); empty: the recipe's layout
    warmup: int = 1  # untimed steps of each side before the measured ones
    rounds: int = 4  # ours, peer, ours, peer ...
    steps_per_round: int = 2
    passes: int = 1  # sweep the layouts this many times round-robin; steps of every pass pool into one median
    peer: bool = True
    peer_partition: str = "same"  # same: the peer runs our layer split; uniform: torch users' even split
    peak_tflops: float = 0.0  # per rank; 0: measure a one-thread fp32 matmul
    results_dir: str = "benchmarks/results"
    name: str = "bench"  # file stem of the results
    profile_rank: int = -1  # >= 0: cProfile our timed steps on this rank, top functions to <name>_profile_*.txt
    timeout_s: float = 1800.0


@dataclass
class BenchRecipe(TrainConfig):
    """A training recipe plus the benchmark's own options (``bench.*``)."""

    bench: BenchOptions = field(default_factory=BenchOptions)


def register_bench_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="modelpar_bench_schema", node=BenchRecipe)


# -- layouts --------------------------------------------------------------------------------------------------

_SPEC_TOKEN = re.compile(r"^(tp|pp|dp|vpp|m)(\d+)$")


def parse_layout(spec: str, base: ParallelConfig) -> ParallelConfig:
    """``base`` with the settings of ``spec``: dash-separated ``tpN ppN dpN vppN mN sp`` and a schedule name
    (``gpipe 1f1b interleaved zb-h1``), ``native`` / ``exchange`` for ``parallel.collectives``, ``uniform`` /
    ``params`` / ``flops`` / ``blocks`` for ``parallel.partition``, ``rc`` for ``parallel.recompute=full``;
    ``single`` is tp=pp=dp=1. E.g. ``tp2-pp2-1f1b``, ``pp2-vpp2-interleaved``, ``tp2-native``, ``pp2-uniform``,
    ``single-rc``.
    Unset degrees are 1; the schedule defaults to 1f1b (interleaved when vpp > 1); m to ``base.microbatches``."""
    values: dict = dict(tp=1, pp=1, dp=1, vpp=1, sp=False, schedule="", microbatches=base.microbatches)
    text = spec.strip().replace("zb-h1", "zbh1")
    for token in text.split("-"):
        match = _SPEC_TOKEN.match(token)
        if token == "single":
            continue
        if match:
            values["microbatches" if match[1] == "m" else match[1]] = int(match[2])
        elif token == "rc":  # parallel.recompute
            values["recompute"] = "full"
        elif token == "sp":
            values["sp"] = True
        elif token in ("native", "exchange"):  # parallel.collectives
            values["collectives"] = token
        elif token in ("uniform", "params", "flops", "blocks"):  # parallel.partition
            values["partition"] = token
        elif token.replace("zbh1", "zb-h1") in SCHEDULES:
            values["schedule"] = token.replace("zbh1", "zb-h1")
        else:
            raise ValueError(
                f"bench.sweep entry {spec!r}: cannot read {token!r}; use tpN, ppN, dpN, vppN, mN, sp, rc, native, "
                f"exchange, uniform, params, flops, blocks or a schedule ({', '.join(SCHEDULES)}), e.g. 'tp2-pp2-1f1b'"
            )
    values["schedule"] = values["schedule"] or ("interleaved" if values["vpp"] > 1 else "1f1b")
    return replace(base, **values)


def layout_name(p: ParallelConfig) -> str:
    """The canonical spec of a layout, its key in ``bench.json``."""
    rc = "-rc" if p.recompute != "none" else ""
    if p.tp == p.pp == p.dp == 1:
        return "single" + (f"-m{p.microbatches}" if p.microbatches != 8 else "") + rc
    parts = [f"{k}{getattr(p, k)}" for k in ("tp", "pp", "dp", "vpp") if getattr(p, k) > 1]
    parts += ["sp"] * (p.sp and p.tp > 1)
    if p.pp > 1:
        parts.append(p.schedule)
    if p.microbatches != 8:
        parts.append(f"m{p.microbatches}")
    if p.collectives != "auto":
        parts.append(p.collectives)
    if p.pp > 1 and p.partition == "explicit":
        parts.append("split" + "+".join(f"{c:g}" for c in p.stage_layers))
    elif p.pp > 1 and p.partition != ParallelConfig.partition:
        parts.append(p.partition)
    return "-".join(parts) + rc


# -- activation memory on CPU ---------------------------------------------------------------------------------


class SavedTensorMeter:
    """Bytes held by tensors autograd saved for backward, live and at peak, counted once per storage.

    Inside ``with meter:`` every saved tensor is packed into a holder that keeps it alive exactly as long as
    autograd would (the graph owns the holder); the holder adds its storage's bytes when the first holder of
    that storage is made and subtracts them when the last one dies. Parameters (``exclude``) are not
    activations and are skipped. ``shapes`` maps (shape, dtype) of each newly held storage's first saved view
    to (count, storage bytes), for a breakdown.
    """

    def __init__(self, exclude: list[torch.Tensor] = ()):
        self.excluded = {_storage_key(t) for t in exclude}
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple, int] = {}
        self.shapes: dict[tuple[tuple[int, ...], str], tuple[int, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key in self.excluded or isinstance(tensor, torch.nn.Parameter):
            return tensor
        count = self._refs.get(key, 0)
        if count == 0:
            self.live += key[2]
            self.peak = max(self.peak, self.live)
            sig = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            seen, nbytes = self.shapes.get(sig, (0, 0))
            self.shapes[sig] = (seen + 1, nbytes + key[2])
        self._refs[key] = count + 1
        # detached: a saved *output* would otherwise point back at its own grad_fn through this holder, a
        # cycle through autograd's C++ graph that keeps nodes retained by retain_graph=True (zero-bubble's B)
        # alive until the step ends, and the meter would report bytes autograd itself has already let go
        return _Saved(self, key, tensor.detach())

    def _release(self, key: tuple) -> None:
        count = self._refs[key] - 1
        if count:
            self._refs[key] = count
        else:
            del self._refs[key]
            self.live -= key[2]


class _Saved:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: tuple, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, storage.data_ptr(), storage.nbytes())


# -- on every rank --------------------------------------------------------------------------------------------


class _StepRecorder:
    """Keeps the ``StepResult`` of the runtime's last step (the trainer's step returns only metrics)."""

    def __init__(self, runtime):
        self.last = None
        self._step = runtime.step
        runtime.step = self

    def __call__(self, *args, **kwargs):
        self.last = self._step(*args, **kwargs)
        return self.last


def _timed(fn, device: torch.device, profiler: cProfile.Profile | None = None) -> tuple[float, float, float]:
    """(seconds, loss, CPU seconds of this process) of ``fn()``, started after a barrier so that every rank's
    clock starts together. CPU over wall seconds is the share of a core the rank got (other jobs share them)."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    cpu = time.process_time()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    loss = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if profiler is not None:
        profiler.disable()
    return time.perf_counter() - start, loss, time.process_time() - cpu


def bench_rank(cfg: BenchRecipe, data_path: str) -> dict:
    """One rank's measurements of ours and the peer (see the module docstring for the order of steps), both
    with this rank bound to its own core when ``trainer.cpu_affinity=auto`` on CPU. Where our trainer puts its
    tensor-parallel group's gloo socket threads at idle priority (``trainer.gloo_threads=idle``, layouts with
    tp > 1), the peer's socket threads go idle too (``peer_socket_threads``: it cannot tell its groups apart),
    which measured 1.06-1.12x faster for it (``benchmarks/results/bench_gloo_threads.md``)."""
    from modelpar.backends.gloo_cpu import gloo_socket_threads, pinned, set_gloo_threads
    from modelpar.cli.train import runs_on_cpu

    pin = cfg.trainer.cpu_affinity == "auto" and dist.get_world_size() > 1 and runs_on_cpu(cfg)
    try:
        with pinned(dist.get_rank(), 1, enabled=pin):
            out = _bench_rank(cfg, data_path)
    finally:
        set_gloo_threads("normal")  # the workers are reused by the next layout
    # without root or CAP_SYS_NICE an idled thread cannot go back to normal: run() then replaces the workers
    out["gloo_threads_restored"] = not any(os.sched_getscheduler(t) == os.SCHED_IDLE for t in gloo_socket_threads())
    return out


def peer_socket_threads(trainer) -> set[int]:
    """The gloo socket threads the peer may use: all but those of our own non-tensor-parallel groups (the
    peer's device mesh makes its own groups, or reuses the world group when a mesh dimension spans it)."""
    from modelpar.backends.gloo_cpu import gloo_socket_threads, socket_threads

    g = trainer.groups
    ours = {tid for group in (g.pp_group, g.dp_group, g.embedding_group) for tid in socket_threads(group)}
    return set(gloo_socket_threads()) - ours


def _bench_rank(cfg: BenchRecipe, data_path: str) -> dict:
    from modelpar.backends.gloo_cpu import set_gloo_threads
    from modelpar.data import WindowSampler
    from modelpar.perf.peers import Peer, peer_name
    from modelpar.pipeline import partition_uniform
    from modelpar.training.build import build_partition, transformer_config
    from modelpar.training.trainer import Trainer

    opts = cfg.bench
    torch.manual_seed(cfg.trainer.seed)
    trainer = Trainer(cfg, data_path, None)
    trainer.runtime.timing = True  # per-action records for every measured step
    recorder = _StepRecorder(trainer.runtime)
    device = trainer.device
    peer = None
    if opts.peer and peer_name(cfg) is not None:
        split = build_partition(cfg)
        if opts.peer_partition == "uniform":
            split = partition_uniform(cfg.model.layers, cfg.parallel.pp, cfg.parallel.vpp)
        peer = Peer(cfg, transformer_config(cfg), split, device)
        if trainer.idle_threads:
            set_gloo_threads("idle", peer_socket_threads(trainer))
        peer_sampler = WindowSampler(
            trainer.tokens.num_windows,
            cfg.data.global_batch,
            trainer.groups.dp_rank,
            trainer.layout.dp,
            cfg.data.seed,
        )

    def ours() -> float:
        return trainer.train_step().loss

    def theirs() -> float:
        inputs, targets = trainer.tokens.batch(peer_sampler.next_batch())
        return peer.step(inputs.to(device), targets.to(device))

    out: dict = {"rank": dist.get_rank(), "pp_rank": trainer.groups.pp_rank, "tp_rank": trainer.groups.tp_rank}
    out["dp_rank"] = trainer.groups.dp_rank
    sides = [("ours", ours)] + [("peer", theirs)] * (peer is not None)
    first = {name: _timed(fn, device)[1] for name, fn in sides}
    out["first_loss"] = first
    for _ in range(opts.warmup - 1):
        for _, fn in sides:
            _timed(fn, device)
    out |= _measure_memory_and_comm(trainer, recorder, ours, device)
    profiler = cProfile.Profile() if opts.profile_rank == dist.get_rank() else None
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    cpu_times: dict[str, list[float]] = {name: [] for name, _ in sides}
    losses: dict[str, list[float]] = {name: [] for name, _ in sides}
    records = []
    for _ in range(opts.rounds):
        for name, fn in sides:
            for _ in range(opts.steps_per_round):
                seconds, loss, cpu = _timed(fn, device, profiler if name == "ours" else None)
                times[name].append(seconds)
                cpu_times[name].append(cpu)
                losses[name].append(loss)
                if name == "ours":
                    records.append(recorder.last.records)
    out |= {"times": times, "cpu_times": cpu_times, "losses": losses, "records": records}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        out["profile"] = text.getvalue()
    return out


def _measure_memory_and_comm(trainer, recorder, step, device: torch.device) -> dict:
    """One step with the memory meter (saved tensors on CPU, allocator peak on CUDA) and ``record_comm`` on."""
    params = [p for p, _ in trainer.model.params]
    meter = SavedTensorMeter(exclude=params)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with record_comm() as log, meter if device.type != "cuda" else contextlib.nullcontext():
        step()
    if device.type == "cuda":
        activation_peak = torch.cuda.max_memory_allocated() - before
    else:
        activation_peak = meter.peak
    comm = log.by_kind()
    sends = sum(1 for a in trainer.runtime.actions if a.kind in (SEND_F, SEND_B))
    if sends:
        elements = 1
        for n in trainer.runtime.activation_shape:
            elements *= n
        comm["p2p_send"] = sends * elements * torch.tensor([], dtype=trainer.runtime.dtype).element_size()
    return {"activation_peak_bytes": activation_peak, "comm_bytes": comm}


# -- in the launching process --------------------------------------------------------------------------------


def _pool(a: dict, b: dict) -> dict:
    """One rank's results of two passes as one: the timed steps of both (memory and comm of the first)."""
    out = dict(a)
    for key in ("times", "cpu_times", "losses"):
        out[key] = {name: a[key][name] + b[key][name] for name in a[key]}
    out["records"] = a["records"] + b["records"]
    return out


def matmul_peak_tflops(n: int = 1024, reps: int = 20) -> float:
    """TFLOP/s of a square fp32 matmul on one thread, the fastest of ``reps`` (a peak: other jobs only slow
    it down): the CPU MFU reference."""
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times) / 1e12


def summarize(cfg: BenchRecipe, per_rank: list[dict], peak_tflops: float, peer: str | None) -> dict:
    """The row of one layout: medians over the timed steps (each step's time is its slowest rank's)."""
    p = cfg.parallel
    layout = p.layout()
    tokens = cfg.data.global_batch * cfg.data.seq_len
    flops = training_flops_per_token(model_shape(cfg.model), cfg.data.seq_len) * tokens

    def side(name: str) -> dict | None:
        if name not in per_rank[0]["times"]:
            return None
        steps = [max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))]
        step_s = statistics.median(steps)
        tflops = flops / step_s / layout.world_size / 1e12
        cpu = [r["cpu_times"][name][i] / r["times"][name][i] for r in per_rank for i in range(len(steps))]
        return {
            "step_s": step_s,
            "cpu_share": statistics.fmean(cpu),
            "step_s_all": steps,
            "tokens_per_s": tokens / step_s,
            "tflops_per_rank": tflops,
            "mfu": tflops / peak_tflops if peak_tflops > 0 else None,
            "first_loss": per_rank[0]["first_loss"][name],
            "losses": per_rank[0]["losses"][name],
        }

    ours, theirs = side("ours"), side("peer")
    rounds = paired_round_ratios(ours["step_s_all"], theirs["step_s_all"], cfg.bench.steps_per_round) if theirs else []
    pipeline = sorted((r for r in per_rank if r["tp_rank"] == 0 and r["dp_rank"] == 0), key=lambda r: r["pp_rank"])
    timelines = [Timeline(tuple(r["records"][i] for r in pipeline)) for i in range(len(pipeline[0]["records"]))]
    durations = _mean_durations(timelines)
    schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.vpp)
    row = {
        "layout": layout_name(p),
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "vpp": p.vpp,
        "sp": p.sp,
        "recompute": p.recompute,
        "schedule": p.schedule if p.pp > 1 else "none",
        "micro_batches": p.microbatches,
        "world_size": layout.world_size,
        "tokens_per_step": tokens,
        "model_flops_per_step": flops,
        "peak_tflops_per_rank": peak_tflops,
        "ours": ours,
        "peer_name": peer,
        "peer": theirs,
        "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs else None,
        "ratio_per_round": rounds,  # the spread says how far the ratio above can be trusted on a noisy machine
        "first_loss_rel_diff": abs(ours["first_loss"] - theirs["first_loss"]) / abs(ours["first_loss"])
        if theirs
        else None,
        "bubble_measured": statistics.median(t.bubble_fraction for t in timelines),
        "bubble_simulated": simulate(schedule, Costs.from_mapping(durations)).bubble_fraction,
        "bubble_replayed": statistics.median(
            simulate(schedule, Costs(per_action=_action_durations(t))).bubble_fraction for t in timelines
        ),
        "compute_s_per_stage": [statistics.median(t.compute_time(r) for t in timelines) for r in range(p.pp)],
        "mean_action_ms": {k: v * 1e3 for k, v in durations.items()},
        "activation_peak_bytes_per_stage": [r["activation_peak_bytes"] for r in pipeline],
        "comm_bytes_per_step": _sum_comm(per_rank),
    }
    row["losses_agree"] = row["first_loss_rel_diff"] <= 1e-5 if theirs else None
    row["_timeline"] = timelines[-1]
    return row


def paired_round_ratios(ours: list[float], peer: list[float], per_round: int) -> list[float]:
    """Our speed over the peer's in each round: the median of the peer's ``per_round`` steps over the median
    of ours. Ours and the peer's steps of one round ran back to back, so a round sees one machine load; the
    spread over rounds is the noise the ratio of whole-run medians carries."""
    if len(ours) != len(peer) or per_round < 1 or len(ours) % per_round:
        raise ValueError(f"{len(ours)} and {len(peer)} steps do not split into rounds of {per_round}")
    return [
        statistics.median(peer[i : i + per_round]) / statistics.median(ours[i : i + per_round])
        for i in range(0, len(ours), per_round)
    ]


def _mean_durations(timelines: list[Timeline]) -> dict[str, float]:
    by_kind: dict[str, list[float]] = {}
    for timeline in timelines:
        for row in timeline.rows:
            for timed in row:
                if timed.action.kind.is_compute:
                    by_kind.setdefault(timed.action.kind.value, []).append(timed.duration)
    return {kind: statistics.fmean(values) for kind, values in sorted(by_kind.items())}


def _action_durations(timeline: Timeline) -> dict:
    return {t.action: t.duration for row in timeline.rows for t in row if t.action.kind.is_compute}


def _sum_comm(per_rank: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in per_rank:
        for kind, nbytes in r["comm_bytes"].items():
            total[kind] = total.get(kind, 0) + nbytes
    return dict(sorted(total.items()))


def add_ideal(rows: dict[str, dict]) -> None:
    """Pipeline rows get the bubble-bound ideal from the single-rank row (same model and batch), if any."""
    for row in rows.values():
        single = rows.get("single" + (f"-m{row['micro_batches']}" if row["micro_batches"] != 8 else ""))
        if row["pp"] > 1 and row["tp"] == row["dp"] == 1 and single:
            m, p = row["micro_batches"], row["pp"]
            ideal = single["ours"]["tokens_per_s"] * p * m / (m + p - 1)
            row["bubble_bound_ideal_tokens_per_s"] = ideal
            row["fraction_of_ideal"] = row["ours"]["tokens_per_s"] / ideal
            # > 1: the stages together computed longer than the single rank did (stage imbalance is not in it)
            row["compute_vs_single"] = sum(row["compute_s_per_stage"]) / sum(single["compute_s_per_stage"])


# -- report ---------------------------------------------------------------------------------------------------

COLUMNS = (
    "layout",
    "ranks",
    "ours tok/s",
    "peer",
    "peer tok/s",
    "ratio",
    "TFLOP/s/rank",
    "MFU",
    "CPU share",
    "bubble meas/sim/replay",
    "of ideal",
    "act. MiB per stage",
    "comm MiB/step",
    "loss rel. diff",
)


def table_rows(rows: dict[str, dict]) -> list[list[str]]:
    out = []
    for row in rows.values():
        ours, peer = row["ours"], row["peer"]
        mib = [f"{b / 2**20:.1f}" for b in row["activation_peak_bytes_per_stage"]]
        comm = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in row["comm_bytes_per_step"].items()) or "-"
        out.append(
            [
                row["layout"],
                str(row["world_size"]),
                f"{ours['tokens_per_s']:,.0f}",
                row["peer_name"] or "-",
                f"{peer['tokens_per_s']:,.0f}" if peer else "-",
                _ratio_cell(row),
                f"{ours['tflops_per_rank']:.4f}",
                f"{ours['mfu']:.1%}" if ours["mfu"] is not None else "-",
                f"{ours['cpu_share']:.2f}" + (f" / {peer['cpu_share']:.2f}" if peer else ""),
                f"{row['bubble_measured']:.1%} / {row['bubble_simulated']:.1%} / {row['bubble_replayed']:.1%}",
                f"{row['fraction_of_ideal']:.2f}" if "fraction_of_ideal" in row else "-",
                " / ".join(mib),
                comm,
                f"{row['first_loss_rel_diff']:.1e}" if peer else "-",
            ]
        )
    return out


def _ratio_cell(row: dict) -> str:
    if not row["ratio"]:
        return "-"
    rounds = row.get("ratio_per_round") or []
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{row['ratio']:.2f}x{spread}"


def markdown_table(rows: dict[str, dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    return "\n".join(lines)


def text_table(rows: dict[str, dict]) -> str:
    body = table_rows(rows)
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def plot_throughput(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    ours = [rows[n]["ours"]["tokens_per_s"] for n in names]
    peer = [rows[n]["peer"]["tokens_per_s"] if rows[n]["peer"] else 0.0 for n in names]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4))
    ax.bar([i - 0.2 for i in x], ours, width=0.4, label="modelpar")
    ax.bar([i + 0.2 for i in x], peer, width=0.4, label="PyTorch peer")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput per layout (median step)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(cfg: BenchRecipe, new_rows: list[dict]) -> dict[str, dict]:
    """Merge ``new_rows`` into ``<results_dir>/<name>.json`` and rewrite the table, plots and timelines."""
    from modelpar.pipeline.gantt import render_png

    out_dir = Path(cfg.bench.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{cfg.bench.name}.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    rows = report.get("rows", {})
    for row in new_rows:
        timeline = row.pop("_timeline")
        if row["pp"] > 1:
            png = out_dir / f"{cfg.bench.name}_timeline_{row['layout']}.png"
            title = f"{row['layout']}: one measured step, bubble {row['bubble_measured']:.1%}"
            render_png(timeline, str(png), title=title)
            row["timeline_png"] = png.name
        rows[row["layout"]] = row
    add_ideal(rows)
    report = {
        "model": asdict(cfg.model),
        "data": {"seq_len": cfg.data.seq_len, "global_batch": cfg.data.global_batch},
        "trainer": {
            "device": cfg.trainer.device,
            "dtype": cfg.trainer.dtype,
            "threads_per_rank": 1,
            "cpu_affinity": cfg.trainer.cpu_affinity,
            "gloo_threads": cfg.trainer.gloo_threads,
        },
        "bench": {k: v for k, v in asdict(cfg.bench).items() if k not in ("sweep", "results_dir", "name")},
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0],
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "flops": "modelpar.model.flops.training_flops_per_token: 6 N + 12 L h s per token (model FLOPs)",
        "rows": rows,
    }
    path.write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / f"{cfg.bench.name}.md").write_text(
        f"# modelpar-bench: {cfg.model.name}, batch {cfg.data.global_batch} x {cfg.data.seq_len}\n\n"
        f"{markdown_table(rows)}\n\n"
        "ratio: our tokens/s over the peer's, interleaved run by run (in brackets the lowest and highest ratio "
        "of single rounds, ours and the peer's steps back to back); CPU share: process CPU seconds over wall "
        "seconds per rank, ours / peer (1.0 = a whole core; other jobs share the 2 cores); bubble: idle compute "
        "over ranks x span, measured from the runtime's records / simulated with the measured mean F/B/W / "
        "replayed with every action's measured duration (so stage imbalance included); of ideal: tokens/s over "
        "single-rank tokens/s x ranks x m/(m+p-1); act.: peak bytes of saved activations per pipeline stage; "
        "comm: bytes per step summed over ranks. Setting for both engines: CPU ranks bound to cores "
        f"(trainer.cpu_affinity={cfg.trainer.cpu_affinity}); gloo socket threads trainer.gloo_threads="
        f"{cfg.trainer.gloo_threads} (idle: our tensor-parallel group's, and all of the peer's, where tp > 1).\n"
    )
    plot_throughput(rows, out_dir / f"{cfg.bench.name}_throughput.png")
    return rows


def check_options(opts: BenchOptions) -> None:
    """Refuse impossible ``bench.*`` values with one line naming the fix, before any rank starts."""
    if opts.peer_partition not in ("same", "uniform"):
        raise ValueError(f"bench.peer_partition={opts.peer_partition!r} must be 'same' or 'uniform'")
    for name in ("rounds", "steps_per_round", "passes"):
        value = getattr(opts, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"bench.{name}={value!r} must be a whole number >= 1 (nothing would be timed)")
    if isinstance(opts.warmup, bool) or not isinstance(opts.warmup, int) or opts.warmup < 1:
        raise ValueError(
            f"bench.warmup={opts.warmup!r} must be a whole number >= 1: each side's first step is always untimed"
        )
    if not opts.peak_tflops >= 0:
        raise ValueError(f"bench.peak_tflops={opts.peak_tflops!r} must be > 0 TFLOP/s per rank, or 0 to measure it")
    if not opts.timeout_s > 0:
        raise ValueError(f"bench.timeout_s={opts.timeout_s!r} must be > 0 seconds")
    if isinstance(opts.profile_rank, bool) or not isinstance(opts.profile_rank, int) or opts.profile_rank < -1:
        raise ValueError(f"bench.profile_rank={opts.profile_rank!r} must be a rank (>= 0), or -1 for no profile")
    if not opts.name or any(c in opts.name for c in "/\\"):
        raise ValueError(f"bench.name={opts.name!r} must be a plain file stem, e.g. bench_mine")


def run(cfg: BenchRecipe) -> dict[str, dict]:
    """Benchmark every layout of ``cfg.bench.sweep`` (or ``cfg.parallel``); returns all rows of the results."""
    from modelpar.cli.train import resolve_data
    from modelpar.data import DataError, TokenFile
    from modelpar.perf.peers import peer_name

    opts = cfg.bench
    check_options(opts)

    def peer_of(case: BenchRecipe) -> str | None:
        name = peer_name(case) if opts.peer else None
        split = name and case.parallel.pp > 1 and opts.peer_partition == "uniform"
        return f"{name} (uniform split)" if split else name

    layouts = [parse_layout(s, cfg.parallel) for s in opts.sweep] or [cfg.parallel]
    cases = []
    for parallel in layouts:
        case = replace(cfg, parallel=parallel)
        case.trainer.steps = max(case.trainer.steps, 1 + opts.warmup + opts.rounds * opts.steps_per_round)
        validate(case)
        cases.append(case)
    worlds = [case.parallel.layout().world_size for case in cases]
    if opts.profile_rank >= max(worlds):
        most = max(worlds)
        raise ValueError(f"bench.profile_rank={opts.profile_rank} is not a rank of any layout (at most {most} ranks)")
    train_path, _ = resolve_data(cfg)
    if TokenFile.open(train_path, cfg.model.vocab_size, cfg.data.seq_len).num_windows < cfg.data.global_batch:
        raise DataError(f"{train_path} holds fewer than data.global_batch={cfg.data.global_batch} windows")
    peak = opts.peak_tflops or run_on_ranks(1, matmul_peak_tflops)[0]
    print(f"modelpar-bench: {cfg.model.name}, {len(cases)} layouts, MFU against {peak:.4f} TFLOP/s per rank")
    pooled: dict[int, list[dict]] = {}
    for k in range(opts.passes):
        for i, case in enumerate(cases):
            name = layout_name(case.parallel)
            peer = peer_of(case)
            world = case.parallel.layout().world_size
            print(
                f"modelpar-bench: pass {k + 1}/{opts.passes} {name} ({world} ranks) vs {peer or 'no peer'}", flush=True
            )
            per_rank = run_on_ranks(world, bench_rank, case, train_path, timeout_s=opts.timeout_s)
            if not all(r["gloo_threads_restored"] for r in per_rank):
                shutdown_pools()  # gloo socket threads stuck at idle priority must not slow the next layout
            pooled[i] = per_rank if k == 0 else [_pool(a, b) for a, b in zip(pooled[i], per_rank, strict=True)]
            for r in per_rank:
                if "profile" in r:
                    out = Path(opts.results_dir) / f"{opts.name}_profile_{name}_rank{r['rank']}_pass{k}.txt"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(r["profile"])
    rows = [summarize(case, pooled[i], peak, peer_of(case)) for i, case in enumerate(cases)]
    all_rows = write_results(cfg, rows)
    print(text_table({r["layout"]: all_rows[r["layout"]] for r in rows}), flush=True)
    return all_rows


register_bench_schema()


def _recipe_layout_requested() -> bool:
    """A multirun, or a ``parallel=`` group on the command line, without ``bench.sweep=``: bench that layout."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    task = list(hydra_cfg.overrides.task)
    if any(o.lstrip("+~").startswith("bench.sweep=") for o in task):
        return False
    return hydra_cfg.mode == RunMode.MULTIRUN or any(o.startswith("parallel=") for o in task)


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="bench")
def _app(dcfg: DictConfig) -> None:
    cfg: BenchRecipe = OmegaConf.to_object(dcfg)
    if _recipe_layout_requested():
        cfg.bench.sweep = []
    try:
        run(cfg)
    except ValueError as exc:
        print(f"modelpar-bench: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def main() -> None:
    _app()


__all__ = ["BenchOptions", "BenchRecipe", "SavedTensorMeter", "main", "parse_layout", "run"]


if __name__ == "__main__":
    main()
