"""Where a tensor-parallel step's time goes: the same steps with and without the tp group's collectives.

    python benchmarks/tp_breakdown.py                                # single, tp2, tp2-pp2-1f1b: ~3 min, 2 cores
    python benchmarks/tp_breakdown.py --layouts tp2 --rounds 8
    python benchmarks/tp_breakdown.py --set model=tiny --set data.global_batch=8   # any recipe override

For each layout the ranks build our ``Trainer`` from ``recipes/bench.yaml`` once (bound to their cores as
``modelpar-bench`` binds them) and alternate, round by round (the order flips every round), between steps
*as trained* and *timing-only* steps in which every collective over the tensor-parallel group returns at once
with a tensor of the right shape (all-reduce: this rank's partial sum; all-gather: copies of this rank's
shard; reduce-scatter: this rank's block), so no byte moves and no rank waits for its partner. Everything else
(pipeline sends, data-parallel and grad-norm collectives) runs as usual. A timing-only step computes wrong
numbers: the weights and optimizer state are restored after every timing-only round, and the replica-drift
check and loss guard are off for the run.

Per layout (each step timed between barriers; medians over rounds, the slowest rank counts):

    tp communication + waiting = step as trained - timing-only step
    compute scaling            = timing-only step x tp / single-rank step      (pp = 1 layouts)

so a scaling above 1.0 is work tensor parallelism does not split (element-wise ops on the replicated residual
stream, per-op host overhead, thinner matmuls). Writes ``benchmarks/results/<name>.{json,md}`` (default
``tp_breakdown``) and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from modelpar.cli.args import check_layouts, positive_int

RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = Path(__file__).resolve().parent.parent / "recipes"
MODES = ("trained", "timing_only")


class _Done:
    """A finished collective's handle."""

    def wait(self) -> bool:
        return True


def skip_tp_collectives(tp_group: dist.ProcessGroup):
    """Patch the engine's collectives (``modelpar.parallel.collectives`` and the tp regions built on them) so
    collectives over ``tp_group`` return at once; returns the undo function."""
    import modelpar.parallel.collectives as comm
    import modelpar.parallel.regions as regions

    saved = {name: getattr(comm, name) for name in ("all_reduce", "all_reduce_async", "all_gather", "reduce_scatter")}

    def all_reduce(tensor, group, op=dist.ReduceOp.SUM):
        return tensor if group is tp_group else saved["all_reduce"](tensor, group, op)

    def all_reduce_async(tensor, group, op=dist.ReduceOp.SUM):
        return _Done() if group is tp_group else saved["all_reduce_async"](tensor, group, op)

    def all_gather(tensor, group, dim=0):
        if group is not tp_group:
            return saved["all_gather"](tensor, group, dim)
        return torch.cat([tensor] * dist.get_world_size(group), dim=dim)

    def reduce_scatter(tensor, group, dim=0):
        if group is not tp_group:
            return saved["reduce_scatter"](tensor, group, dim)
        world = dist.get_world_size(group)
        return tensor.chunk(world, dim)[dist.get_rank(group)].contiguous()

    for name, fn in (
        ("all_reduce", all_reduce),
        ("all_reduce_async", all_reduce_async),
        ("all_gather", all_gather),
        ("reduce_scatter", reduce_scatter),
    ):
        for module in (comm, regions):
            if hasattr(module, name):
                setattr(module, name, fn)

    def undo() -> None:
        for name, fn in saved.items():
            for module in (comm, regions):
                if hasattr(module, name):
                    setattr(module, name, fn)

    return undo


def rank_ab(cfg, data_path: str, rounds: int, steps: int) -> dict:
    """One rank: ``rounds`` x (``steps`` trained steps and ``steps`` timing-only ones), alternating order."""
    from modelpar.backends.gloo_cpu import pinned
    from modelpar.training.trainer import Trainer

    out = {mode: [] for mode in MODES} | {f"{mode}_cpu": [] for mode in MODES}
    with pinned(dist.get_rank(), 1, enabled=cfg.trainer.cpu_affinity == "auto" and dist.get_world_size() > 1):
        torch.manual_seed(cfg.trainer.seed)
        trainer = Trainer(cfg, data_path, None)
        trainer.train_step()  # warm-up: allocator, thread pools, first-touch of every buffer
        tp_group = trainer.groups.tp_group if trainer.layout.tp > 1 else None
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                if mode == "timing_only" and tp_group is None:
                    continue
                undo, saved = None, None
                if mode == "timing_only":
                    weights = [p for p, _ in trainer.model.params]
                    saved = ([p.detach().clone() for p in weights], copy.deepcopy(trainer.optimizer.state_dict()))
                    undo = skip_tp_collectives(tp_group)
                try:
                    for _ in range(steps):
                        dist.barrier()
                        wall, cpu = time.perf_counter(), time.process_time()
                        trainer.train_step()
                        out[mode].append(time.perf_counter() - wall)
                        out[f"{mode}_cpu"].append(time.process_time() - cpu)
                finally:
                    if undo is not None:
                        undo()
                        with torch.no_grad():
                            for p, kept in zip(weights, saved[0], strict=True):
                                p.copy_(kept)
                        trainer.optimizer.load_state_dict(saved[1])
    return out


def layout_case(base, spec: str, rounds: int, steps: int):
    """The recipe ``base`` under layout ``spec``, validated (raises ``ValueError`` naming the problem)."""
    from modelpar.bench.layout_spec import parse_layout
    from modelpar.training.config import validate

    cfg = replace(base, parallel=parse_layout(spec, base.parallel))
    cfg.trainer = replace(cfg.trainer, steps=max(cfg.trainer.steps, 2 + rounds * steps * len(MODES)))
    validate(cfg)
    return cfg


def run_layout(cfg, data_path: str, rounds: int, steps: int) -> dict:
    from modelpar.bench.layout_spec import layout_name
    from modelpar.testing import run_on_ranks

    world = cfg.parallel.layout().world_size
    per_rank = run_on_ranks(world, rank_ab, cfg, data_path, rounds, steps, timeout_s=1800)
    row = {"layout": layout_name(cfg.parallel), "ranks": world, "tp": cfg.parallel.tp, "pp": cfg.parallel.pp}
    tokens = cfg.data.global_batch * cfg.data.seq_len
    for mode in MODES:
        if not per_rank[0][mode]:
            continue
        step = statistics.median(max(ts) for ts in zip(*(r[mode] for r in per_rank), strict=True))
        cpu = statistics.median(statistics.median(r[f"{mode}_cpu"]) for r in per_rank)
        row[mode] = {"step_s": step, "cpu_s_per_rank": cpu, "tokens_per_s": tokens / step}
    if "timing_only" in row:
        row["tp_comm_and_wait_s"] = row["trained"]["step_s"] - row["timing_only"]["step_s"]
        row["tp_comm_and_wait_share"] = row["tp_comm_and_wait_s"] / row["trained"]["step_s"]
    return row


def add_scaling(rows: list[dict]) -> None:
    single = next((r for r in rows if r["ranks"] == 1), None)
    for row in rows:
        if single is not None and row["pp"] == 1 and "timing_only" in row:
            row["compute_scaling"] = row["timing_only"]["step_s"] * row["tp"] / single["trained"]["step_s"]


def markdown(rows: list[dict], rounds: int, steps: int) -> str:
    lines = [
        "# Tensor-parallel step breakdown: as trained vs the tp group's collectives skipped",
        "",
        "| layout | ranks | step s as trained | tok/s | step s, tp collectives skipped | tok/s | "
        "tp comm + waiting | share of step | compute scaling (x tp / single) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["trained"]
        if "timing_only" in r:
            o = r["timing_only"]
            skipped = f"{o['step_s']:.3f} | {o['tokens_per_s']:,.0f}"
            comm = f"{r['tp_comm_and_wait_s'] * 1e3:.0f} ms | {r['tp_comm_and_wait_share']:.1%}"
        else:
            skipped, comm = "- | -", "- | -"
        scaling = f"{r['compute_scaling']:.2f}" if "compute_scaling" in r else "-"
        lines.append(
            f"| {r['layout']} | {r['ranks']} | {t['step_s']:.3f} | {t['tokens_per_s']:,.0f} | {skipped} | {comm} "
            f"| {scaling} |"
        )
    lines += [
        "",
        f"Medians over {rounds} rounds of {steps} step(s) per mode, both modes in the same rank processes (order "
        "flipping every round), each step timed between barriers (the slowest rank counts). Skipped: every "
        "collective over the tensor-parallel group returns at once (wrong numbers, weights restored after each "
        "round); tp comm + waiting: the difference, i.e. the exchanges themselves plus the time a rank waits "
        "for its partner to arrive. Compute scaling: the skipped step times tp over the single-rank step "
        "(1.00 = tensor parallelism splits all the work).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tp_breakdown.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["single", "tp2", "tp2-pp2-1f1b"])
    ap.add_argument("--rounds", type=positive_int, default=6)
    ap.add_argument("--steps", type=positive_int, default=2, help="steps per mode per round")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    ap.add_argument("--name", default="tp_breakdown", help="results file stem")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    check_layouts(ap, args.layouts)
    if "/" in args.name:
        ap.error(f"--name {args.name!r}: a file stem, without '/'")
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from modelpar.bench.config import register_bench_schema
    from modelpar.data import TokenFile
    from modelpar.training.preflight import resolve_data

    register_bench_schema()
    overrides = [
        "trainer.out_dir=runs/tp-breakdown",
        "trainer.progress=false",
        "trainer.check_every=0",  # timing-only steps leave the tp replicas apart on purpose
        "trainer.spike_factor=0",
        *args.set,
    ]
    try:
        with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
            base = OmegaConf.to_object(compose(config_name="bench", overrides=overrides))
    except HydraException as exc:
        ap.error(f"--set: {str(exc).splitlines()[0]}")
    try:
        cases = [layout_case(base, spec, args.rounds, args.steps) for spec in args.layouts]
        data_path, _ = resolve_data(base)
        if TokenFile.open(data_path, base.model.vocab_size, base.data.seq_len).num_windows < base.data.global_batch:
            raise ValueError(f"{data_path} holds fewer than data.global_batch={base.data.global_batch} windows")
    except ValueError as exc:  # RecipeError, DataError: before any rank starts
        ap.error(str(exc).splitlines()[0])
    rows = []
    for cfg in cases:
        row = run_layout(cfg, str(data_path), args.rounds, args.steps)
        rows.append(row)
        print(f"{row['layout']}: {row['trained']['tokens_per_s']:,.0f} tokens/s as trained", flush=True)
    add_scaling(rows)
    text = markdown(rows, args.rounds, args.steps)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0]}
    payload = {"rounds": args.rounds, "steps": args.steps, "overrides": args.set, "machine": machine, "rows": rows}
    (args.results_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (args.results_dir / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    # Run as a script this file is __main__, which the rank workers cannot import: import it by name so that
    # run_on_ranks can pickle rank_ab.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tp_breakdown

    tp_breakdown.main()
