"""Muon's step beside AdamW's in one run: bench-tiny at dp2 ZeRO-1 and tp2, on CPU ranks.

    python benchmarks/muon_step.py                       # 3 rounds x (AdamW, Muon bf16, Muon fp32) per layout
    python benchmarks/muon_step.py --rounds 5 --steps 6

The model and batch are ``modelpar-bench``'s (``recipes/bench.yaml``: bench-tiny, 8 layers, hidden 256, vocab
4096; batch 16 x 128 in 8 micro-batches; fp32, one thread per rank). Each round runs every optimizer once, in
turn (so drift in the machine's load hits all alike): a fresh 2-rank job, one warm-up step, then ``--steps``
timed steps; the optimizer's own ``step()`` (for Muon: momentum, the two all-to-alls, Newton-Schulz, the
update) is timed inside them, and inside that Muon's Newton-Schulz and its exchange (an all-to-all's time
includes waiting for the other rank). Reported per layout and optimizer: the median over rounds of the mean
step time and of the optimizer-step time, Muon's ratio to AdamW, the Newton-Schulz and exchange seconds per
step, the same two as CPU seconds of the rank's own thread (``time.thread_time``: what the rank computed,
not the time it waited for a core on a loaded machine, nor for the other rank), and each rank's Newton-Schulz
FLOPs per step with the owner assignment's balance (busiest rank over the mean). The machine's load average
before and after each job is recorded and printed under the table. Results: ``benchmarks/results/muon_step.json`` and
``muon_step.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
LAYOUTS = {"dp2-zero1": dict(dp=2, zero=1), "tp2": dict(tp=2, zero=0)}
PARTS = ("newton_schulz_s", "exchange_s")  # per step, inside Muon's optimizer step (the max over ranks)
OPTIMIZERS = {"adamw": dict(name="adamw"), "muon-bf16": dict(name="muon"), "muon-fp32": dict(name="muon")}


def timed_rank(cfg, data_path: str, steps: int) -> dict:
    """On every rank: one warm-up step, then ``steps`` timed ones; the seconds of each step and of its
    optimizer step, and this rank's Newton-Schulz FLOPs per step (0 under AdamW) and the assignment's balance."""
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    opt = trainer.optimizer
    inner, spent = opt.step, []

    spent_cpu: list[float] = []

    def step() -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        inner()
        spent.append(time.perf_counter() - start)
        spent_cpu.append(time.thread_time() - cpu)

    opt.step = step
    torch_opt = getattr(opt.optimizer, "shard_optimizer", opt.optimizer)
    layout = getattr(torch_opt, "layout", None)
    parts: dict[str, list] = {k: [] for k in PARTS}
    if layout is not None:  # where Muon's step goes: its Newton-Schulz and its two all-to-alls, timed apart
        for attr, key in (("_newton_schulz", "newton_schulz_s"), ("_transport", "exchange_s")):
            setattr(layout, attr, _timed(getattr(layout, attr), parts[key]))
    trainer.train_step()
    spent.clear()
    spent_cpu.clear()
    for v in parts.values():
        v.clear()
    times, cpu_times = [], []
    for _ in range(steps):
        start, cpu = time.perf_counter(), time.thread_time()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - cpu)
    return {
        "step_s": times,
        "optimizer_step_s": spent,
        "step_cpu_s": cpu_times,
        "optimizer_step_cpu_s": spent_cpu,
        **{k: sum(v) / steps for k, v in parts.items()},
        "ns_flops": layout.my_ns_flops() if layout else 0,
        "ns_balance": layout.balance() if layout else None,
        "muon_matrices": len(layout.matrices) if layout else 0,
    }


def _timed(fn, into: list):
    def run(*args):
        start = time.perf_counter()
        out = fn(*args)
        into.append(time.perf_counter() - start)
        return out

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.testing import run_on_ranks
    from modelpar.training.config import register_schema, validate
    from modelpar.training.preflight import resolve_data

    register_schema()
    overrides = [
        "model=bench-tiny",
        "parallel.microbatches=8",
        "data.seq_len=128",
        "data.global_batch=16",
        "trainer.out_dir=runs/muon-step",
        "trainer.ckpt_every=0",
        "trainer.progress=false",
        "trainer.sample_tokens=0",
        "trainer.check_every=0",
        "trainer.dtype=fp32",
    ]
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        base = OmegaConf.to_object(compose(config_name="single", overrides=overrides))
    data_path, _ = resolve_data(base)
    raw: dict[str, dict[str, list]] = {lay: {o: [] for o in OPTIMIZERS} for lay in LAYOUTS}
    loads: list[float] = []  # the machine's 1-minute load average before and after each job
    for layout, parallel in LAYOUTS.items():
        for round_ in range(args.rounds):
            for label, optim in OPTIMIZERS.items():
                ns = "fp32" if label.endswith("fp32") else "bf16"
                cfg = replace(
                    base,
                    parallel=replace(base.parallel, tp=parallel.get("tp", 1), dp=parallel.get("dp", 1)),
                    optim=replace(base.optim, zero=parallel["zero"], muon_ns_dtype=ns, **optim),
                )
                validate(cfg)
                load = os.getloadavg()[0]
                ranks = run_on_ranks(2, timed_rank, cfg, str(data_path), args.steps, timeout_s=1800)
                loads.extend([load, os.getloadavg()[0]])
                raw[layout][label].append(ranks)
                mean = statistics.mean(ranks[0]["step_s"])
                print(f"{layout} {label} round {round_}: {mean:.3f} s/step (load {load:.1f})", flush=True)
    rows = [
        "| layout | optimizer | step s (median of rounds) | x AdamW | optimizer step s | x AdamW | of which NS s | "
        "of which exchange s | step CPU s | x AdamW | optimizer step CPU s | x AdamW | NS GFLOP per rank per step "
        "| NS balance (max/mean) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    summary: dict = {}
    for layout in LAYOUTS:
        med = {}
        for label, rounds in raw[layout].items():
            step = statistics.median(max(statistics.mean(r["step_s"]) for r in ranks) for ranks in rounds)
            opt = statistics.median(max(statistics.mean(r["optimizer_step_s"]) for r in ranks) for ranks in rounds)
            ns, ex = (statistics.median(max(r[k] for r in ranks) for ranks in rounds) for k in PARTS)
            cpu = [
                statistics.median(max(statistics.mean(r[k]) for r in ranks) for ranks in rounds)
                for k in ("step_cpu_s", "optimizer_step_cpu_s")
            ]
            med[label] = (step, opt, [r["ns_flops"] for r in rounds[0]], rounds[0][0]["ns_balance"], ns, ex, *cpu)
        for label, (step, opt, flops, balance, ns, ex, step_cpu, opt_cpu) in med.items():
            base_step, base_opt = med["adamw"][0], med["adamw"][1]
            base_step_cpu, base_opt_cpu = med["adamw"][6], med["adamw"][7]
            gflops = " / ".join(f"{f / 1e9:.2f}" for f in flops)
            bal = "-" if balance is None else f"{balance:.2f}"
            rows.append(
                f"| {layout} | {label} | {step:.3f} | {step / base_step:.2f} | {opt:.4f} | {opt / base_opt:.1f} | "
                f"{ns:.4f} | {ex:.4f} | {step_cpu:.3f} | {step_cpu / base_step_cpu:.2f} | {opt_cpu:.4f} | "
                f"{opt_cpu / base_opt_cpu:.1f} | {gflops} | {bal} |"
            )
            summary[f"{layout}/{label}"] = {
                "step_s": step,
                "step_ratio": step / base_step,
                "optimizer_step_s": opt,
                "optimizer_step_ratio": opt / base_opt,
                "ns_flops_per_rank": flops,
                "ns_balance": balance,
                "newton_schulz_s": ns,
                "exchange_s": ex,
                "step_cpu_s": step_cpu,
                "step_cpu_ratio": step_cpu / base_step_cpu,
                "optimizer_step_cpu_s": opt_cpu,
                "optimizer_step_cpu_ratio": opt_cpu / base_opt_cpu,
            }
    load_line = f"Machine load (1-minute load average, {os.cpu_count()} cores): {min(loads):.1f} to {max(loads):.1f}"
    md = "\n".join(rows) + "\n\n" + load_line + "\n"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "muon_step.md").write_text(md)
    (args.results_dir / "muon_step.json").write_text(
        json.dumps(
            {
                "summary": summary,
                "raw": raw,
                "rounds": args.rounds,
                "steps": args.steps,
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "load_average": loads,
            },
            indent=1,
        )
    )
    print(md)


if __name__ == "__main__":
    main()
