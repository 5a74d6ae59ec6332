"""Layout benchmarks of the trainer's step, raced run by run against PyTorch's own parallelism (``modelpar-bench``).

    rows = run(cfg)        # cfg: a BenchRecipe (recipes/bench.yaml); the command line is modelpar.cli.bench

For each layout (a ``bench.sweep`` entry such as ``tp2-pp2-1f1b-m8``; or the recipe's ``parallel`` group when
the sweep is empty, in a multirun, or when ``parallel=`` is given without ``bench.sweep=``) the ranks
(``modelpar.parallel.pool.run_on_ranks``: local processes, gloo over loopback, one thread each) build our
``Trainer`` and the peer of the layout (``modelpar.bench.peers``) from the same weights and data, then
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
  most bytes held at once by tensors autograd saved for backward (``SavedTensorMeter``; offload's host copies
  apart), and the model states of each rank (``trainer_state_bytes`` at the optimizer step: weights, gradients,
  optimizer state, gradient buckets; FSDP2's gathered weights and unsharded gradients at their peak), each
  beside ``modelpar-plan``'s prediction for the same recipe (``modelpar.bench.recipe_memory.recipe_memory``) on the
  stage's fullest rank;
- communication bytes per step by kind (``modelpar.parallel.collectives.record_comm``, summed over ranks) plus the
  pipeline's p2p sends (activation bytes x SEND actions, which the runtime posts outside ``comm``); under
  context parallelism the ring's K/V and dK/dV blocks count as ``send_recv``, the all-gather's as
  ``all_gather``/``reduce_scatter``, and cp rows get the ideal ``cp x single-rank tokens/s``;
- the peer's tokens/s, our ratio to it, and whether the first step's losses agree (relative 1e-5). The peer
  runs our layer split (``bench.peer_partition=same``), or with ``uniform`` the even split a user of
  ``torch.distributed.pipelining`` gets without a partitioner, named "(uniform split)" in the table.

Results accumulate in ``bench.results_dir`` (empty: ``trainer.out_dir``; ``modelpar-bench`` fills in the run's
Hydra directory, or a multirun's sweep directory so its jobs' rows merge; the committed ``benchmarks/results``
changes only when named): ``bench.json`` (one row per layout; a
rerun replaces its layout's row), ``bench.md``, ``bench_throughput.png`` and, per pipeline layout, the
measured timeline of one step, ``bench_timeline_<layout>.png``. The table is printed too.

Beside this file: ``bench_config`` (the ``bench.*`` schema), ``layout_spec`` (the sweep's layout words),
``memory`` (``SavedTensorMeter``), ``peers`` (what we race), ``summary`` (per-rank measurements -> one row)
and ``report`` (rows -> bench.json, tables, plots). The command line is ``modelpar.cli.bench``.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import itertools
import marshal
import os
import pstats
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from modelpar.backends.gloo_cpu import RankSetup, gloo_socket_threads, pinned, set_gloo_threads, socket_threads
from modelpar.bench.config import BenchRecipe, check_options
from modelpar.bench.layout_spec import case_name, parse_case
from modelpar.bench.meters import GatheredMeter, SavedTensorMeter, StateProbe
from modelpar.bench.peers import Peer, peer_name, torch_context_parallel_problem
from modelpar.bench.report import text_table, write_results
from modelpar.bench.summary import pool_passes, summarize
from modelpar.data import DataError, WindowSampler
from modelpar.parallel.collectives import record_comm, record_waits
from modelpar.parallel.pool import run_on_ranks, shutdown_pools
from modelpar.pipeline import StepResult, partition_uniform
from modelpar.pipeline.actions import SEND_B, SEND_F
from modelpar.training.build import build_partition
from modelpar.training.config import validate
from modelpar.training.preflight import open_windows, resolve_data, runs_on_cpu
from modelpar.training.trainer import Trainer

# what each rank does first: one thread, not bound to a core (``bench_rank`` binds it while it measures), and
# its gloo groups' socket threads noted, so that ``trainer.gloo_threads=idle`` can find them
BENCH_RANK = RankSetup()


# -- on every rank --------------------------------------------------------------------------------------------


class OurSteps:
    """Our trainer's optimizer steps, one per call (returns the loss), keeping the runtime's ``StepResult`` of
    the last one: its per-action records, with ``trainer.runtime.timing`` on."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self._steps = itertools.count(trainer.step)
        self.last: StepResult | None = None

    def __call__(self) -> float:
        metrics, self.last = self.trainer.train_one(next(self._steps))
        return metrics.loss


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
    pin = cfg.trainer.cpu_affinity == "auto" and dist.get_world_size() > 1 and runs_on_cpu(cfg)
    try:
        with pinned(dist.get_rank(), 1, enabled=pin):
            out = _bench_rank(cfg, data_path)
    finally:
        set_gloo_threads("normal")  # the workers are reused by the next layout
    # without root or CAP_SYS_NICE an idled thread cannot go back to normal: run() then replaces the workers
    out["gloo_threads_restored"] = not any(os.sched_getscheduler(t) == os.SCHED_IDLE for t in gloo_socket_threads())
    return out


def peer_socket_threads(trainer: Trainer) -> set[int]:
    """The gloo socket threads the peer may use: all but those of our own non-tensor-parallel groups (the
    peer's device mesh makes its own groups, or reuses the world group when a mesh dimension spans it)."""
    g = trainer.groups
    ours = {tid for group in (g.pp_group, g.dp_group, g.embedding_group) for tid in socket_threads(group)}
    return set(gloo_socket_threads()) - ours


def _bench_rank(cfg: BenchRecipe, data_path: str) -> dict:
    opts = cfg.bench
    torch.manual_seed(cfg.trainer.seed)
    trainer = Trainer(cfg, data_path, None)
    trainer.runtime.timing = True  # per-action records for every measured step
    ours = OurSteps(trainer)
    device = trainer.device
    peer = None
    if opts.peer and peer_name(cfg) is not None:
        split = build_partition(cfg)
        if opts.peer_partition == "uniform":
            split = partition_uniform(cfg.model.layers, cfg.parallel.pp, cfg.parallel.vpp)
        peer = Peer(cfg, cfg.model, split, device)
        if trainer.idle_threads:
            set_gloo_threads("idle", peer_socket_threads(trainer))
        peer_sampler = WindowSampler(
            trainer.tokens.num_windows,
            cfg.data.global_batch,
            trainer.groups.dp_rank,
            trainer.layout.dp,
            cfg.data.seed,
        )

    def theirs() -> float:
        inputs, targets = trainer.tokens.batch(peer_sampler.next_batch())
        return peer.step(inputs.to(device), targets.to(device))

    out: dict = {"rank": dist.get_rank(), "pp_rank": trainer.groups.pp_rank, "tp_rank": trainer.groups.tp_rank}
    out["dp_rank"] = trainer.groups.dp_rank
    out["cp_rank"] = trainer.groups.cp_rank
    if opts.peer and cfg.parallel.cp > 1 and trainer.layout.world_size == cfg.parallel.cp:
        out["peer_note"] = torch_context_parallel_problem(device)
    sides = [("ours", ours)] + [("peer", theirs)] * (peer is not None)
    first = {name: _timed(fn, device)[1] for name, fn in sides}
    out["first_loss"] = first
    for _ in range(opts.warmup - 1):
        for _, fn in sides:
            _timed(fn, device)
    out |= _measure_memory_and_comm(trainer, ours, device)
    if opts.trace_comm:
        out["exposed_comm"] = exposed_comm(ours, device)
    out["pair_handovers"] = trainer.runtime.pair_handovers
    profiled = opts.profile_rank == dist.get_rank()
    profilers = {name: cProfile.Profile() for name, _ in sides} if profiled else {}
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    cpu_times: dict[str, list[float]] = {name: [] for name, _ in sides}
    losses: dict[str, list[float]] = {name: [] for name, _ in sides}
    records = []
    for _ in range(opts.rounds):
        for name, fn in sides:
            for _ in range(opts.steps_per_round):
                seconds, loss, cpu = _timed(fn, device, profilers.get(name))
                times[name].append(seconds)
                cpu_times[name].append(cpu)
                losses[name].append(loss)
                if name == "ours":
                    records.append(ours.last.records)
    out |= {"times": times, "cpu_times": cpu_times, "losses": losses, "records": records}
    if profilers:
        out["profile"] = {name: _profile_text(profiler) for name, profiler in profilers.items()}
        out["profile_stats"] = {name: pstats.Stats(profiler).stats for name, profiler in profilers.items()}
    return out


def _profile_text(profiler: cProfile.Profile) -> str:
    """The top functions by own time, then by cumulative time (what a step does beyond its peer shows there)."""
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
    return text.getvalue()


COLLECTIVE_KINDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "send_recv")


def exposed_comm(step, device: torch.device) -> dict[str, dict[str, float]]:
    """One step under ``collectives.record_waits``: per collective kind, the host seconds spent waiting in it
    (on every thread; a profiler trace shows the same waits as ``kind:tag`` ranges) and how many waits. What
    was hidden behind other work is not in them."""
    dist.barrier()
    with record_waits() as log:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return {kind: {"seconds": log.seconds[kind], "count": log.count[kind]} for kind in COLLECTIVE_KINDS}


def _measure_memory_and_comm(trainer: Trainer, step, device: torch.device) -> dict:
    """One step with the memory meters (saved tensors on CPU, allocator peak on CUDA; model states at the
    optimizer step, FSDP2's gathered bytes sampled along the step) and ``record_comm`` on."""
    params = [p for p, _ in trainer.model.params]
    gathered = GatheredMeter(trainer.model.chunks)
    meter = SavedTensorMeter(exclude=params, gathered=gathered if gathered else None)
    probe = StateProbe(trainer)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with record_comm() as log, meter if device.type != "cuda" else contextlib.nullcontext():
        step()
    probe.remove()
    states = dict(probe.bytes or {})
    states |= {"gathered": gathered.peak, "gathered_weights": gathered.peak_weights}
    states["gathered_gradients"] = gathered.peak_gradients
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
    return {
        "activation_peak_bytes": activation_peak,
        "activation_host_peak_bytes": meter.host_peak,
        "state_bytes": states,
        "comm_bytes": comm,
    }


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


# -- in the launching process --------------------------------------------------------------------------------


def run(cfg: BenchRecipe) -> dict[str, dict]:
    """Benchmark every layout of ``cfg.bench.sweep`` (or ``cfg.parallel``); returns all rows of the results."""
    opts = cfg.bench
    check_options(opts)
    if not opts.results_dir:
        opts.results_dir = cfg.trainer.out_dir

    def peer_of(case: BenchRecipe) -> str | None:
        name = peer_name(case) if opts.peer else None
        split = name and case.parallel.pp > 1 and opts.peer_partition == "uniform"
        return f"{name} (uniform split)" if split else name

    cases = []
    for case in [parse_case(s, cfg) for s in opts.sweep] or [cfg]:
        case = replace(case, trainer=replace(case.trainer))
        case.trainer.steps = max(case.trainer.steps, 1 + opts.warmup + opts.rounds * opts.steps_per_round)
        validate(case)
        cases.append(case)
    worlds = [case.parallel.layout().world_size for case in cases]
    if opts.profile_rank >= max(worlds):
        most = max(worlds)
        raise ValueError(f"bench.profile_rank={opts.profile_rank} is not a rank of any layout (at most {most} ranks)")
    train_path, _ = resolve_data(cfg)
    if open_windows(cfg, train_path).num_windows < cfg.data.global_batch:
        raise DataError(f"{train_path} holds fewer than data.global_batch={cfg.data.global_batch} windows")
    peak = opts.peak_tflops or run_on_ranks(1, matmul_peak_tflops, rank_setup=BENCH_RANK)[0]
    print(f"modelpar-bench: {cfg.model.name}, {len(cases)} layouts, MFU against {peak:.4f} TFLOP/s per rank")
    pooled: dict[int, list[dict]] = {}
    for k in range(opts.passes):
        for i, case in enumerate(cases):
            name = case_name(case)
            peer = peer_of(case)
            world = case.parallel.layout().world_size
            print(
                f"modelpar-bench: pass {k + 1}/{opts.passes} {name} ({world} ranks) vs {peer or 'no peer'}", flush=True
            )
            per_rank = run_on_ranks(
                world, bench_rank, case, train_path, timeout_s=opts.timeout_s, rank_setup=BENCH_RANK
            )
            if not all(r["gloo_threads_restored"] for r in per_rank):
                shutdown_pools()  # gloo socket threads stuck at idle priority must not slow the next layout
            pooled[i] = per_rank if k == 0 else [pool_passes(a, b) for a, b in zip(pooled[i], per_rank, strict=True)]
            for r in per_rank:
                for side, text in r.get("profile", {}).items():
                    out = Path(opts.results_dir) / f"{opts.name}_profile_{name}_{side}_rank{r['rank']}_pass{k}.txt"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(text)
                    with open(out.with_suffix(".prof"), "wb") as f:  # pstats.Stats(path) reads it
                        marshal.dump(r["profile_stats"][side], f)
                    print(f"modelpar-bench: wrote {out} and {out.with_suffix('.prof').name}", flush=True)
    rows = [summarize(case, pooled[i], peak, peer_of(case)) for i, case in enumerate(cases)]
    all_rows, written = write_results(cfg, rows)
    print(text_table({r["layout"]: all_rows[r["layout"]] for r in rows}), flush=True)
    print(f"modelpar-bench: wrote {', '.join(str(p) for p in written)}", flush=True)
    return all_rows
