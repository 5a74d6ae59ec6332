"""Activation memory of one transformer layer: measured saved-tensor bytes against Korthikanti et al. 2022.

    python benchmarks/activation_memory.py                  # bench-tiny's layer, b=2, s=128; tp 1 and 2, sp off/on
    python benchmarks/activation_memory.py --batch 1 --seq 256

One block of ``modelpar.model.transformer`` (a ``ModelChunk`` holding one layer, nothing else) runs forward on emulated
ranks (gloo, one thread each) with ``modelpar.bench.meters.SavedTensorMeter`` on: the bytes of every tensor autograd
keeps for backward, once per storage, parameters excluded, which is exactly what stays alive per layer and
micro-batch until its backward. Beside it, the paper's per-layer formula for 16-bit activations (table 2)::

    tp=1                s*b*h*(34 + 5*a*s/h)
    tp=t                s*b*h*(10 + 24/t + 5*a*s/(h*t))
    tp=t + SP           s*b*h*(34 + 5*a*s/h) / t

and ``modelpar-plan``'s own model of our block (``modelpar.plan.activations.block_bytes``: the tensors listed
below, derived from the code, fp32), which the measurement should equal.

Why the two differ (the JSON's ``breakdown`` lists every saved shape and dtype, in units of s*b*h elements):

- our CPU activations are fp32, 4 bytes where the paper counts 2;
- attention runs as SDPA, which on CPU (and flash attention on GPU) keeps its output and one log-sum-exp per
  query row, never the ``a*s*s`` scores, softmax and dropout mask of the ``5*a*s/h`` term;
- there is no dropout: the paper's ``34`` holds three 1-byte masks (attention probabilities aside);
- Llama's block is not GPT's: RMSNorm instead of LayerNorm, RoPE on q and k, and a SwiGLU MLP with
  ``ffn_hidden`` (688 = 2.69 h here) instead of GELU at 4 h, so the MLP keeps gate, up and their product
  instead of two 4h tensors.

Where our tp=1 layer's 22.85 s*b*h fp32 elements go (the breakdown below, storages counted whole): the fused
gate|up output (5.38, silu's and the product's input), silu(gate) (2.69) and the product feeding down_proj
(2.69): 10.75 against GELU's 9 (h + 4h + 4h); q and k after RoPE (2), the fused qkv output kept whole because
v is a view of it (3), the attention output (1): 6 plus the flattened inputs of the projections, against
the paper's 5 (input, q, k, v, softmax-weighted values) without scores; each RMSNorm keeps its input and the
normalised copy (2 per norm, LayerNorm 1). In 16-bit units that is 45.7 s*b*h bytes against the paper's 34
(its 5*a*s/h = 20 more of scores we never store); with tp=2 the attention and MLP parts halve and the rest
does not (14.46), and SP shards the norms' and residual's share too (12.46; the paper's /t assumes all of it
shards, while the all-gathered inputs of the column-parallel projections stay whole here).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

from modelpar import ParallelLayout
from modelpar.bench.meters import SavedTensorMeter
from modelpar.cli.args import positive_int
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_chunk
from modelpar.plan import HARDWARE, ModelSpec, Strategy
from modelpar.plan.activations import block_bytes
from modelpar.testing import current_groups, run_on_ranks

RESULTS = Path(__file__).resolve().parent / "results"
BENCH_TINY = ModelConfig(vocab_size=4096, hidden=256, layers=8, heads=8, kv_heads=8, ffn_hidden=688)


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool) -> float:
    """Per-layer activation bytes for 16-bit training (Korthikanti et al. 2022, table 2, no recompute)."""
    if sp or t == 1:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def measure_layer(config: ModelConfig, batch: int, seq: int, sp: bool) -> dict:
    """On one rank: saved bytes of one block's forward on input [b, s, h] ([b, s/t, h] with SP)."""
    groups = current_groups()
    t = groups.layout.tp
    chunk = build_chunk(config, groups, [0], first=False, last=False, seed=0, sequence_parallel=sp)
    local_seq = seq // t if sp and t > 1 else seq
    x = torch.randn(batch, local_seq, config.hidden, requires_grad=True)
    meter = SavedTensorMeter(exclude=list(chunk.parameters()))
    with meter:
        y = chunk(x)
    measured = meter.live
    y.sum().backward()
    unit = seq * batch * config.hidden
    breakdown = sorted(
        (
            {"shape": list(shape), "dtype": dtype, "count": n, "storage_bytes": nbytes, "sbh": nbytes / 4 / unit}
            for (shape, dtype), (n, nbytes) in meter.shapes.items()
        ),
        key=lambda e: -e["sbh"],
    )
    return {"bytes": measured, "peak_bytes": meter.peak, "breakdown": breakdown}


def run(config: ModelConfig, batch: int, seq: int) -> list[dict]:
    s, b, h, a = seq, batch, config.hidden, config.heads
    rows = []
    for t, sp in ((1, False), (2, False), (2, True)):
        per_rank = run_on_ranks(t, measure_layer, config, batch, seq, sp, layout=ParallelLayout(tp=t))
        got = per_rank[0]
        paper = korthikanti_bytes(s, b, h, a, t, sp)
        no_scores = paper - s * b * h * 5 * a * s / h / (t if (sp or t > 1) else 1)
        planner = block_bytes(ModelSpec(config), Strategy(ParallelLayout(tp=t), b, 1, sp=sp), s, HARDWARE["cpu"])
        rows.append(
            {
                "tp": t,
                "sp": sp,
                "measured_bytes": got["bytes"],
                "measured_sbh_elements": got["bytes"] / 4 / (s * b * h),
                "korthikanti_16bit_bytes": paper,
                "korthikanti_fp32_bytes": 2 * paper,
                "korthikanti_fp32_without_scores_bytes": 2 * no_scores,
                "ratio_measured_to_16bit": got["bytes"] / paper,
                "ratio_measured_to_fp32_without_scores": got["bytes"] / (2 * no_scores),
                "planner_bytes": planner,
                "ratio_planner_to_measured": planner / got["bytes"],
                "per_rank_bytes": [r["bytes"] for r in per_rank],
                "breakdown": got["breakdown"],
            }
        )
    return rows


HEADER = (
    f"{'tp':>2} {'sp':<3} {'measured KiB':>12} {'x s*b*h fp32':>12} {'paper 16-bit KiB':>16} {'ratio':>6} "
    f"{'paper fp32 no-scores KiB':>24} {'ratio':>6} {'planner KiB':>11} {'ratio':>6}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['tp']:>2} {'on' if r['sp'] else 'off':<3} {r['measured_bytes'] / 1024:>12.0f} "
        f"{r['measured_sbh_elements']:>12.2f} {r['korthikanti_16bit_bytes'] / 1024:>16.0f} "
        f"{r['ratio_measured_to_16bit']:>6.2f} {r['korthikanti_fp32_without_scores_bytes'] / 1024:>24.0f} "
        f"{r['ratio_measured_to_fp32_without_scores']:>6.2f} {r['planner_bytes'] / 1024:>11.0f} "
        f"{r['ratio_planner_to_measured']:>6.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=positive_int, default=2, help="micro-batch size (bench-tiny: 16 / 8 = 2)")
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS / "activation_memory.json")
    args = parser.parse_args()
    config = replace(BENCH_TINY, max_seq_len=max(args.seq, BENCH_TINY.max_seq_len))
    rows = run(config, args.batch, args.seq)
    lines = [HEADER] + [format_row(r) for r in rows]
    print("\n".join(lines))
    s, b, h, a = args.seq, args.batch, config.hidden, config.heads
    report = {
        "model": {"hidden": h, "heads": a, "ffn_hidden": config.ffn_hidden, "kernels": "torch (CPU)"},
        "seq_len": s,
        "micro_batch": b,
        "dtype": "fp32",
        "formula": "Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes (16-bit); /t with TP+SP; "
        "s*b*h*(10 + 24/t + 5*a*s/(h*t)) with TP alone; planner: modelpar.plan.activations.block_bytes",
        "torch": torch.__version__,
        "platform": platform.platform(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    table = ["| " + " | ".join(c.strip() for c in _columns()) + " |", "|" + "---|" * len(_columns())]
    for r in rows:
        table.append(
            f"| {r['tp']} | {'on' if r['sp'] else 'off'} | {r['measured_bytes'] / 1024:.0f} | "
            f"{r['measured_sbh_elements']:.2f} | {r['korthikanti_16bit_bytes'] / 1024:.0f} | "
            f"{r['ratio_measured_to_16bit']:.2f} | {r['korthikanti_fp32_without_scores_bytes'] / 1024:.0f} | "
            f"{r['ratio_measured_to_fp32_without_scores']:.2f} | {r['planner_bytes'] / 1024:.0f} | "
            f"{r['ratio_planner_to_measured']:.3f} |"
        )
    breakdown = "\n".join(
        f"- {e['count']} x {e['dtype']} {e['shape']}: storage of {e['sbh']:.2f} s*b*h fp32 elements"
        for e in rows[0]["breakdown"]
    )
    args.out.with_suffix(".md").write_text(
        f"# Activation memory per layer: s={s}, b={b}, h={h}, a={a}, fp32 on CPU\n\n"
        + "\n".join(table)
        + "\n\nSaved tensors of one tp=1 layer (what backward keeps):\n\n"
        + breakdown
        + "\n\n"
        + __doc__.split("Why the two differ")[1].split("\n", 1)[1]
    )
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


def _columns() -> list[str]:
    return [
        "tp",
        "sp",
        "measured KiB",
        "measured, s*b*h fp32 elements",
        "paper 16-bit KiB",
        "ratio",
        "paper x2 (fp32) without the 5as/h scores, KiB",
        "ratio",
        "planner (plan_memory) KiB",
        "planner / measured",
    ]


if __name__ == "__main__":
    # Run as a script this file is __main__, which forkserver workers cannot import: re-import it by name.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import activation_memory

    activation_memory.main()
