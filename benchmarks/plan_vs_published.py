"""The planner against published large-scale runs: Narayanan et al. 2021 (Table 1, 1.7B to 1T, and GPT-3 175B).

    python benchmarks/plan_vs_published.py          # a few seconds, no GPU: the planner is a formula

For every run of ``modelpar.plan.published`` (which states the source and what the rows mean):

1. **predicted**: the planner's per-GPU TFLOP/s (the paper's Eq. 3 FLOPs over the predicted step) for the
   published layout on its A100 80GB preset, Megatron-LM 2021's features only (full recompute, no ZeRO, no
   SP, data-parallel all-reduce not overlapped); the planner picks micro-batch size and interleaving, which
   the table does not give. For GPT-3 175B the paper gives no tp/pp, so the planner picks the layout as well.
   The residual is ``predicted / published - 1``.
2. **planner's choice**: its best strategy with every modelpar feature allowed (selective recompute,
   sequence parallel, ZeRO-1, overlapped data-parallel all-reduce), and its predicted step time against the
   published layout's (both predicted, so the ratio is the planner's claim, not a measurement).

Then the H100 runs (``H100_RUNS``: Llama 3 405B from the Llama 3 paper's Table 4, Llama 3.1 8B from torchtitan's
benchmarks): the planner's prediction of the published layout, with the choices the source does not state taken
as each row's ``assumed`` says, on the H100 80GB preset at the default costs (the same efficiency as the A100 rows).

Writes ``benchmarks/results/plan_vs_published.{md,json}`` and ``plan_vs_published_h100.{md,json}``, and prints
both tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from modelpar.plan import HARDWARE, plan
from modelpar.plan.published import (
    GPT3_175B,
    H100_RUNS,
    H100_SOURCE,
    SEQ_LEN,
    SOURCE,
    TABLE_1,
    H100Run,
    PublishedRun,
    h100_residual,
    predicted_h100,
    predicted_tflops,
)

RESULTS = Path(__file__).resolve().parent / "results"


def compare(run: PublishedRun) -> dict:
    predicted, chosen = predicted_tflops(run)
    a100 = HARDWARE["a100-80gb"]
    as_published = plan(run.model, a100, gpus=run.gpus, global_batch=run.global_batch, seq_len=SEQ_LEN)
    layout = (run.tp, run.pp)
    target = (chosen.layout.tp, chosen.layout.pp)

    def as_in_2021(s) -> bool:  # the predicted layout, with 2021's features: full recompute, no ZeRO, no SP
        return (s.layout.tp, s.layout.pp) == target and s.recompute == "full" and not s.zero1 and not s.sp

    same_layout = [e for e in as_published if as_in_2021(e.strategy)]
    best = as_published[0]
    return {
        "run": run.name,
        "where": run.where,
        "billions": run.billions,
        "gpus": run.gpus,
        "global_batch": run.global_batch,
        "published_layout": None if None in layout else {"tp": run.tp, "pp": run.pp},
        "published_tflops_per_gpu": run.tflops_per_gpu,
        "predicted_tflops_per_gpu": predicted,
        "residual": predicted / run.tflops_per_gpu - 1,
        "predicted_strategy": str(chosen),
        "planner_choice": str(best.strategy),
        "planner_choice_step_s": best.prediction.total_s,
        "published_layout_step_s": same_layout[0].prediction.total_s if same_layout else None,
        "planner_choice_memory_gib": best.prediction.memory.total / 2**30,
    }


def markdown(rows: list[dict]) -> str:
    head = (
        "| run | GPUs | batch | layout (tp x pp) | published TFLOP/s/GPU | predicted | residual | "
        "predicted with | planner's choice (all features) | its step vs the published layout's |"
    )
    lines = [f"# Planner vs published runs ({SOURCE})", "", head, "|" + "---|" * 10]
    for r in rows:
        layout = r["published_layout"]
        layout_cell = f"{layout['tp']} x {layout['pp']}" if layout else "not given (planner's)"
        speedup = (
            f"{r['published_layout_step_s'] / r['planner_choice_step_s']:.2f}x faster"
            if r["published_layout_step_s"]
            else "-"
        )
        lines.append(
            f"| {r['run']} ({r['where']}) | {r['gpus']:,} | {r['global_batch']:,} | {layout_cell} | "
            f"{r['published_tflops_per_gpu']:.0f} | {r['predicted_tflops_per_gpu']:.1f} | {r['residual']:+.1%} | "
            f"{r['predicted_strategy']} | {r['planner_choice']} | {speedup} |"
        )
    residuals = [r["residual"] for r in rows]
    lines += [
        "",
        f"Residual over the {len(rows)} runs: mean {statistics.fmean(residuals):+.1%}, mean absolute "
        f"{statistics.fmean(abs(x) for x in residuals):.1%}, worst {max(residuals, key=abs):+.1%}. "
        "Predicted: Eq. 3 FLOPs (full recomputation counted) over the planner's step for the published layout "
        "on its A100 80GB preset, Megatron-LM 2021 features only (full recompute, no ZeRO or SP, data-parallel "
        "all-reduce not overlapped), efficiency at the planner's default (not fitted to these rows); the "
        "micro-batch size and interleaving are the planner's (strategy: layout, micro-batch b, micro-batches "
        "m). Planner's choice: its fastest fitting strategy with every modelpar feature; the speed-up is "
        "predicted against the published layout's predicted step, not measured.",
    ]
    return "\n".join(lines) + "\n"


def compare_h100(run: H100Run) -> dict:
    p = predicted_h100(run)
    predicted, residual = h100_residual(run)
    by_vpp = {}
    if run.pp > 1:  # the interleaving depth is assumed: how much the prediction leans on it
        for v in (2, 4, 8):
            by_vpp[v] = h100_residual(dataclasses.replace(run, vpp=v))[1]
    return {
        "run": run.name,
        "where": run.where,
        "gpus": run.gpus,
        "layout": str(run.strategy),
        "seq_len": run.seq_len,
        "global_batch": run.global_batch,
        "metric": "TFLOP/s/GPU" if run.tflops_per_gpu else "tokens/s/GPU",
        "published": run.tflops_per_gpu or run.tokens_per_gpu,
        "predicted": predicted,
        "residual": residual,
        "residual_by_vpp": by_vpp,
        "predicted_mfu": p.mfu,
        "predicted_memory_gib": p.memory.total / 2**30,
        "assumed": run.assumed,
    }


def markdown_h100(rows: list[dict]) -> str:
    head = (
        "| run | GPUs | strategy (published + assumed) | seq | batch | figure | published | predicted | residual | "
        "residual at vpp 2 / 4 / 8 | planner's memory (GiB) | assumed |"
    )
    lines = [f"# Planner vs published H100 runs ({H100_SOURCE})", "", head, "|" + "---|" * 12]
    for r in rows:
        vpp = " / ".join(f"{x:+.1%}" for x in r["residual_by_vpp"].values()) or "-"
        lines.append(
            f"| {r['run']} ({r['where']}) | {r['gpus']:,} | {r['layout']} | {r['seq_len']:,} | {r['global_batch']:,} | "
            f"{r['metric']} | {r['published']:,.0f} | {r['predicted']:,.0f} | {r['residual']:+.1%} | {vpp} | "
            f"{r['predicted_memory_gib']:.0f} | {r['assumed']} |"
        )
    lines += [
        "",
        "Predicted: the planner's step for the strategy shown on its H100 80GB preset (989 TFLOP/s bf16, 3.35 TB/s, "
        "NVLink 450 GB/s per direction, 50 GB/s per GPU between nodes), default costs (efficiency 0.55, the A100 "
        "rows' value, not fitted to these). TFLOP/s are model FLOPs (modelpar.model.flops) over the step. Memory is "
        "modelpar's own block and engine (fp32 master weights and moments, its saved tensors): above 80 GiB for the "
        "405B rows, which ran in 80 GB, so the planner would not choose these strategies itself; the step time is "
        "predicted regardless.",
        "",
        'Sources: Llama 3 405B, Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4 (GPUs, '
        "tp, cp, pp, 16M-token batch, TFLOP/s per GPU; restated from the authors' SC'24 slides at "
        "https://glennklockwood.com/garden/llama-3.1, without sequence lengths: 8K and 128K, the paper's two "
        "pretraining stages, assumed). Llama 3.1 8B, github.com/pytorch/torchtitan "
        "docs/performance.md, "
        "Table 1 (8 H100 96GB at 500 W, FSDP 8, local batch 2, global 16, selective activation checkpointing, 5,762 "
        "tokens/s per GPU without torch.compile; sequence length not stated). Not found stated for H100/H200 in bf16 "
        "with layout and throughput, so not used: Llama 3 70B and a mixture-of-experts run (the NeMo performance "
        "tables found give FP8 figures).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    rows = [compare(run) for run in [*TABLE_1, GPT3_175B]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_vs_published.json").write_text(json.dumps({"source": SOURCE, "rows": rows}, indent=1) + "\n")
    text = markdown(rows)
    (args.out / "plan_vs_published.md").write_text(text)
    print(text)
    h100 = [compare_h100(run) for run in H100_RUNS]
    (args.out / "plan_vs_published_h100.json").write_text(
        json.dumps({"source": H100_SOURCE, "rows": h100}, indent=1) + "\n"
    )
    text = markdown_h100(h100)
    (args.out / "plan_vs_published_h100.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
