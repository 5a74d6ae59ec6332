"""Mixture-of-experts speed: the grouped expert GEMM against per-expert loops, and expert parallelism's
tokens/s against its ideal.

    .venv/bin/python benchmarks/moe.py                 # both parts, ~3 minutes on 2 cores
    .venv/bin/python benchmarks/moe.py --part layer    # one MoE layer only
    .venv/bin/python benchmarks/moe.py --smoke         # tiny shapes, one round (for tests)

Part ``layer``: one MoE layer (softmax top-2, 8 experts), forward + backward on one thread, three ways on the
same weights and tokens, interleaved round by round (min and median of ``--rounds``):

- ``grouped``: what the layer runs (``model.moe.grouped_gemm=true``): rows sorted by expert once, each of
  w1 / w3 / w2 one ``torch._grouped_mm`` over all experts;
- ``sorted loop``: the same sorted rows, one matmul per expert (``grouped_gemm=false``, the reference);
- ``masked loop``: the per-expert loop of the Hugging Face Mixtral block: for each expert, find its tokens,
  gather them, run the expert, scale and add back (no sort).

Part ``steps``: ``modelpar-bench`` on ``model=bench-moe`` (4 layers, 8 experts), 64 sequences of 128 tokens in
one micro-batch: one rank, dp2 x ep2 and dp2 without ep, dropless and with ``capacity_factor=1.0`` (which
bounds how unevenly the router loads the two ranks' experts); ep2's ideal is twice the one-rank tokens/s. The
all-to-all bytes per step come from the bench's communication record (every byte handed to
``all_to_all_single``, including the rows that stay on their own rank).

Writes ``benchmarks/results/moe.json`` and ``moe.md`` (``--out`` to change the stem) and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _masked_loop(layer, x: torch.Tensor) -> torch.Tensor:
    """The Mixtral reference block's per-expert loop over ``layer``'s weights: x [b, s, h] -> [b, s, h]."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.linear(tokens, layer.gate_weight).float().softmax(-1)
    weights, chosen = probs.topk(layer.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    y = torch.zeros_like(tokens)
    for e in range(layer.experts):
        rows, slot = torch.where(chosen == e)
        if rows.numel() == 0:
            continue
        h = tokens[rows]
        out = F.linear(F.silu(F.linear(h, layer.w1[e])) * F.linear(h, layer.w3[e]), layer.w2[e])
        y = y.index_add(0, rows, out * weights[rows, slot].unsqueeze(-1))
    return y.view_as(x)


def _layer(hidden: int, ffn: int, experts: int, grouped: bool, device: str = "cpu"):
    from modelpar.model.config import ModelConfig, MoEConfig
    from modelpar.model.moe import MoELayer
    from modelpar.parallel.regions import TensorParallelGroup

    moe = MoEConfig(experts=experts, top_k=2, ffn_hidden=ffn, grouped_gemm=grouped)
    cfg = ModelConfig(
        vocab_size=256, hidden=hidden, layers=1, heads=8, kv_heads=8, ffn_hidden=ffn, max_seq_len=128, moe=moe
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg, TensorParallelGroup(), device=device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5)
    return layer


def bench_layer(shapes: list[dict], rounds: int, device: str = "cpu") -> list[dict]:
    """Rows of ``shapes`` timed three ways (fp32 on CPU, one thread; bf16 autocast on CUDA)."""
    torch.set_num_threads(1)
    cuda = device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for shape in shapes:
        h, f, e, t = shape["hidden"], shape["ffn"], shape["experts"], shape["tokens"]
        grouped, loop = _layer(h, f, e, True, device), _layer(h, f, e, False, device)
        loop.load_state_dict(grouped.state_dict())
        x = torch.randn(8, t // 8, h, device=device)
        tol = dict(rtol=3e-2, atol=3e-2) if cuda else dict(rtol=1e-4, atol=1e-5)
        with autocast:
            want = grouped(x)
            for name, got in (("sorted loop", loop(x)), ("masked loop", _masked_loop(grouped, x))):
                torch.testing.assert_close(got.float(), want.float(), **tol, msg=f"{name} differs from grouped")
        variants = {
            "grouped": grouped,
            "sorted loop": loop,
            "masked loop": functools.partial(_masked_loop, grouped),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds + 1):  # the first round warms up
            for name, run in variants.items():
                xi = x.clone().requires_grad_(True)
                sync()
                start = time.perf_counter()
                with autocast:
                    out = run(xi)
                out.float().square().sum().backward()
                sync()
                times[name].append(time.perf_counter() - start)
        row = dict(shape, device=device, dtype="bf16" if cuda else "fp32")
        for name, ts in times.items():
            row[name] = {"min_ms": min(ts[1:]) * 1e3, "median_ms": statistics.median(ts[1:]) * 1e3}
        row["sorted_loop_over_grouped"] = row["sorted loop"]["median_ms"] / row["grouped"]["median_ms"]
        row["masked_loop_over_grouped"] = row["masked loop"]["median_ms"] / row["grouped"]["median_ms"]
        rows.append(row)
    return rows


def bench_steps(smoke: bool) -> dict:
    """``modelpar-bench`` rows of bench-moe, dropless and capped; returns them with the ratios to the ideal."""
    results: dict = {}
    sweep = "[single-m1,dp2-ep2-m1,dp2-m1]"
    for label, extra in (("dropless", []), ("capacity 1.0", ["model.moe.capacity_factor=1.0"])):
        name = "scratch_moe_" + label.replace(" ", "_")
        cmd = [
            str(ROOT / ".venv/bin/modelpar-bench"),
            "model=bench-moe",
            f"bench.sweep={sweep}",
            "bench.peer=false",
            f"bench.name={name}",
            "bench.results_dir=runs/bench-moe",
            *extra,
        ]
        if smoke:
            cmd += ["bench.rounds=1", "bench.passes=1", "data.global_batch=4", "data.seq_len=32"]
        else:
            cmd += ["data.global_batch=64"]  # 8192 tokens a step: the dp gradient all-reduce is amortised
        result = ROOT / "runs/bench-moe" / f"{name}.json"
        result.unlink(missing_ok=True)  # the bench merges into an existing file
        subprocess.run(cmd, check=True, cwd=ROOT)
        by_layout = json.loads(result.read_text())["rows"]
        single = by_layout["single-m1"]["ours"]["tokens_per_s"]
        out = {}
        for layout, row in by_layout.items():
            ours = row["ours"]
            out[layout] = {
                "tokens_per_s": ours["tokens_per_s"],
                "cpu_share": ours.get("cpu_share"),
                "all_to_all_mib_per_step": row["comm_bytes_per_step"].get("all_to_all", 0) / 2**20,
                "of_ideal": ours["tokens_per_s"] / (single * row["world_size"]),
            }
        results[label] = out
    return results


def render(layer_rows: list[dict], steps: dict | None) -> str:
    lines = ["# Mixture of experts: grouped GEMM and expert parallelism", ""]
    if layer_rows:
        lines += [
            f"One MoE layer, softmax top-2, forward + backward, {layer_rows[0]['device']} {layer_rows[0]['dtype']} "
            "(one thread on CPU; median of the rounds, ms):",
            "",
            "| tokens | experts | hidden | expert ffn | grouped | sorted loop | masked loop | sorted / grouped "
            "| masked / grouped |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in layer_rows:
            lines.append(
                f"| {r['tokens']} | {r['experts']} | {r['hidden']} | {r['ffn']} | {r['grouped']['median_ms']:.1f} "
                f"| {r['sorted loop']['median_ms']:.1f} | {r['masked loop']['median_ms']:.1f} "
                f"| {r['sorted_loop_over_grouped']:.2f}x | {r['masked_loop_over_grouped']:.2f}x |"
            )
        lines.append("")
    if steps:
        lines += [
            "Training steps of bench-moe (modelpar-bench, the whole batch in one micro-batch, one thread per rank); "
            "ideal = ranks x the one-rank tokens/s:",
            "",
            "| routing | layout | tokens/s | of ideal | CPU share | all-to-all MiB/step |",
            "|---|---|---|---|---|---|",
        ]
        for label, rows in steps.items():
            for layout, r in rows.items():
                share = f"{r['cpu_share']:.2f}" if r["cpu_share"] is not None else "-"
                lines.append(
                    f"| {label} | {layout} | {r['tokens_per_s']:,.0f} | {r['of_ideal']:.2f}x | {share} "
                    f"| {r['all_to_all_mib_per_step']:.1f} |"
                )
        lines.append("")
    return "\n".join(lines)


SHAPES = [
    dict(tokens=1024, experts=8, hidden=256, ffn=512),  # bench-moe's layer, one rank's micro-batch
    dict(tokens=128, experts=8, hidden=256, ffn=512),  # 32 rows per expert: per-op overhead matters
    dict(tokens=1024, experts=8, hidden=64, ffn=128),  # small experts
]
GPU_SHAPES = [  # Mixtral's widths at one rank's micro-batch, and bench-moe's layer
    dict(tokens=4096, experts=8, hidden=4096, ffn=14336),
    dict(tokens=4096, experts=8, hidden=256, ffn=512),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "layer", "steps"), default="all")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and one round")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/moe"))
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the layer part (bf16 autocast)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} must be >= 1")
    shapes = [replace_shape(s, tokens=64) for s in SHAPES] if args.smoke else SHAPES
    if args.device != "cpu" and args.part != "layer":
        parser.error(f"--device={args.device} runs the layer part only; add --part layer")
    rounds = 1 if args.smoke else args.rounds
    layer_rows = bench_layer(shapes, rounds, args.device) if args.part in ("all", "layer") else []
    steps = bench_steps(args.smoke) if args.part in ("all", "steps") else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"layer": layer_rows, "steps": steps}, indent=1) + "\n")
    text = render(layer_rows, steps)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def replace_shape(shape: dict, **changes) -> dict:
    return {**shape, **changes}


if __name__ == "__main__":
    sys.exit(main())
