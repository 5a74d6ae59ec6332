"""The planner's predicted step time against measured ``modelpar-bench`` steps on this CPU machine.

    python benchmarks/plan_vs_measured.py                      # calibrate, bench 6 layouts twice (~6 min)
    python benchmarks/plan_vs_measured.py --from-json benchmarks/results/bench.json   # reuse a bench run

In one run:

1. calibrate ``modelpar.plan``'s ``cpu`` hardware preset: peak FLOP/s from a one-thread fp32 matmul (the
   shapes of bench-tiny's biggest GEMM and a square one; the faster counts), and the gloo links from
   all-reduces of 4 B .. 4 MiB between two ranks, fitted to the planner's own ring model
   ``2(n-1)/n * bytes / bw + 2(n-1) * latency`` by least squares (a send/recv ping-pong is reported beside);
2. run ``modelpar-bench`` (no peer) for each layout, one thread per rank, median of the timed steps;
3. predict each layout with ``modelpar.plan.predict`` twice: with ``CostModel()`` as shipped (efficiency
   0.55) and with the efficiency fitted on the single-rank layout (one global knob, as ``CostModel`` says;
   the measured element-wise and per-layer overhead terms are held fixed in the fit);
   the residual is ``predicted / measured - 1``. Goal: within 20 %.

The calibration also times the element-wise work tp repeats on every rank (two RMSNorm + residual pairs),
the host overhead of a layer (our block at hidden 32 on 8-token sequences), the cost of an all-reduce
inside a loop of matmuls (what a tp step sees; the isolated fit is recorded beside), and how much slower a
bench-tiny block's forward + backward runs with the other core busy with the same (``busy_slowdown``), and
gives the planner the core count, so a 4-rank layout on 2 cores is predicted as time-shared. Other jobs
share the cores as well; the JSON records the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from modelpar.backends.gloo_cpu import priority_restorable
from modelpar.cli.args import check_layouts, positive_int
from modelpar.plan import HARDWARE, CostModel, ModelSpec, Strategy, predict
from modelpar.plan.step_time import replicated_elementwise_s
from modelpar.testing import run_on_ranks, shutdown_pools

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = ["single", "tp2", "pp2-1f1b", "pp2-vpp2-interleaved", "dp2", "tp2-pp2-1f1b"]


def matmul_flops(shapes=((2048, 256, 688), (1024, 1024, 1024)), reps: int = 20) -> float:
    """Best FLOP/s over ``(m, k, n)`` fp32 matmuls on one thread (the fastest rep: what the core can do; the
    fitted efficiency absorbs the rest, so a moment of load while calibrating does not skew every row)."""
    torch.set_num_threads(1)
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        best = max(best, 2 * m * k * n / min(times))
    return best


def elementwise_bandwidth(shape=(2, 128, 256), reps: int = 30) -> float:
    """Bytes/s of the element-wise work tp repeats per layer, by the planner's own count: the median time of
    two RMSNorm + residual-add pairs, forward and backward, at bench-tiny's micro-batch shape, over
    ``REPLICATED_PASSES`` activation-sized passes."""
    from modelpar_kernels import rms_norm

    from modelpar.plan.step_time import REPLICATED_PASSES

    torch.set_num_threads(1)
    x = torch.randn(shape, requires_grad=True)
    weight = torch.ones(shape[-1], requires_grad=True)
    times = []
    for _ in range(reps + 3):
        start = time.perf_counter()
        y = x
        for _ in range(2):
            y = y + rms_norm(y, weight, 1e-5)
        y.sum().backward()
        times.append(time.perf_counter() - start)
    return REPLICATED_PASSES * x.numel() * 4 / min(times[3:])  # the fastest rep, as for the peak


def layer_overhead(layers: int = 8, reps: int = 20) -> float:
    """Seconds of one layer's forward + backward that do not scale with its size: our ``Block`` at hidden 32
    (8 heads of 4, SwiGLU 32) on 2 sequences of 8 tokens, where matmuls, attention scores and element-wise
    work are all negligible and what remains is op dispatch and autograd bookkeeping."""
    from modelpar.model.config import ModelConfig
    from modelpar.model.spec import ChunkSpec
    from modelpar.model.transformer import Block

    torch.set_num_threads(1)
    config = ModelConfig(vocab_size=64, hidden=32, layers=layers, heads=8, kv_heads=8, ffn_hidden=32)
    blocks = torch.nn.Sequential(*(Block(config, ChunkSpec.whole(layers)) for _ in range(layers)))
    x = torch.randn(2, 8, 32, requires_grad=True)
    times = []
    for _ in range(reps + 3):
        start = time.perf_counter()
        blocks(x).sum().backward()
        times.append(time.perf_counter() - start)
    return min(times[3:]) / layers  # the fastest rep, as for the peak


def busy_slowdown(reps: int = 8) -> float:
    """On 2 ranks: how much slower one bench-tiny block's forward + backward (micro-batch 2 x 128, hidden 256)
    runs while the other rank runs the same loop on the other core than while it is idle (the fastest rep of
    each; shared caches and memory bandwidth)."""
    from modelpar.model.config import ModelConfig
    from modelpar.model.spec import ChunkSpec
    from modelpar.model.transformer import Block

    torch.set_num_threads(1)
    config = ModelConfig(vocab_size=4096, hidden=256, layers=8, heads=8, kv_heads=8, ffn_hidden=688)
    blocks = torch.nn.Sequential(*(Block(config, ChunkSpec.whole(config.layers)) for _ in range(2)))
    x = torch.randn(2, 128, 256, requires_grad=True)
    rank = dist.get_rank()

    def loop() -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            blocks(x).sum().backward()
            times.append(time.perf_counter() - start)
        return min(times)

    loop()  # warm-up
    alone, together = [], []
    for _ in range(3):
        dist.barrier()
        if rank == 0:
            alone.append(loop())
        dist.barrier()  # rank 1 waits here, idle, while rank 0 runs alone
        together.append(loop())
    dist.barrier()
    return min(together) / min(alone) if rank == 0 else 0.0


def all_reduce_in_loop(nbytes: int = 262144, reps: int = 200) -> float:
    """On 2 ranks: what one engine all-reduce of ``nbytes`` adds to a loop of ~1 ms matmuls, as in a tp step
    (no barrier before each one, so the ranks' drift and the thread hand-offs count), bound and with the socket
    threads idle as the trainer runs its tp group."""
    from modelpar.backends.gloo_cpu import pinned, set_gloo_threads
    from modelpar.parallel import collectives

    torch.set_num_threads(1)
    a, b, x = torch.randn(256, 256), torch.randn(256, 768), torch.zeros(nbytes // 4)

    def loop(with_comm: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
            if with_comm:
                collectives.all_reduce(x, None)
        return time.perf_counter() - start

    # as a tp step runs: bound to its core, the group's gloo socket thread idle (trainer.gloo_threads=idle)
    with pinned(dist.get_rank(), 1):
        set_gloo_threads("idle")
        try:
            loop(True)
            plain = min(loop(False) for _ in range(3))
            return (min(loop(True) for _ in range(3)) - plain) / reps
        finally:
            set_gloo_threads("normal")


def gloo_links(sizes=(4, 65536, 262144, 1 << 20, 4 << 20), rounds: int = 20) -> dict:
    """On 2 ranks: median all-reduce time per size, through the engine's collectives (``modelpar.parallel.collectives``,
    algorithm ``auto``) and gloo's native ring beside; and half a send/recv round trip of 256 KiB."""
    from modelpar.backends import gloo_cpu
    from modelpar.parallel import collectives

    rank = dist.get_rank()
    out = {"all_reduce_s": {}, "native_all_reduce_s": {}, "p2p_one_way_s": {}}
    for key, algorithm in (("all_reduce_s", "auto"), ("native_all_reduce_s", "native")):
        gloo_cpu.set_collective_algorithm(algorithm)
        for nbytes in sizes:
            x = torch.zeros(nbytes // 4)
            times = []
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                collectives.all_reduce(x, None)
                times.append(time.perf_counter() - start)
            out[key][nbytes] = statistics.median(times)
    gloo_cpu.set_collective_algorithm("auto")
    for nbytes in (4, 262144):
        x = torch.zeros(nbytes // 4)
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            times.append((time.perf_counter() - start) / 2)
        out["p2p_one_way_s"][nbytes] = statistics.median(times)
    return out


def fit_ring(all_reduce_s: dict[int, float], ranks: int = 2) -> tuple[float, float]:
    """(bandwidth B/s, latency s) of ``t = 2(n-1)/n * bytes / bw + 2(n-1) * latency``, least squares."""
    sizes = np.array(list(all_reduce_s), dtype=float)
    times = np.array(list(all_reduce_s.values()))
    design = np.stack([2 * (ranks - 1) / ranks * sizes, np.full_like(sizes, 2 * (ranks - 1))], axis=1)
    (inv_bw, latency), *_ = np.linalg.lstsq(design, times, rcond=None)
    return 1.0 / inv_bw, max(latency, 0.0)


def bench_rows(layouts: list[str], rounds: int, passes: int, results_dir: Path, name: str) -> dict[str, dict]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.bench.config import register_bench_schema
    from modelpar.bench.harness import run
    from modelpar.training.config import RECIPES

    register_bench_schema()
    overrides = [
        f"bench.sweep=[{','.join(layouts)}]",
        "bench.peer=false",
        f"bench.rounds={rounds}",
        f"bench.passes={passes}",
        "bench.steps_per_round=2",
        f"bench.results_dir={results_dir}",
        f"bench.name={name}",
        "trainer.out_dir=runs/bench",
    ]
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="bench", overrides=overrides))
    return run(cfg)


def model_spec(report: dict) -> ModelSpec:
    from modelpar.model.config import ModelConfig

    m = report["model"]
    fields = ("name", "vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "tie_embeddings")
    return ModelSpec(ModelConfig(**{k: m[k] for k in fields}), flash_attention=True)


def strategy_of(row: dict, global_batch: int) -> Strategy:
    from modelpar.bench.layout_spec import parse_layout
    from modelpar.parallel.layout import ParallelLayout
    from modelpar.training.config import ParallelConfig

    layout = ParallelLayout(tp=row["tp"], pp=row["pp"], dp=row["dp"], vpp=row["vpp"])
    m = row["micro_batches"]
    # rows written before the field existed: the layout's canonical name carries it ("-rc")
    recompute = row.get("recompute") or parse_layout(row["layout"], ParallelConfig()).recompute
    return Strategy(layout, global_batch // row["dp"] // m, m, recompute=recompute, sp=row["sp"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--passes", type=positive_int, default=2, help="sweeps of the layouts, round-robin")
    parser.add_argument("--from-json", type=Path, help="use the rows of an earlier modelpar-bench run")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_vs_measured.json")
    args = parser.parse_args()
    check_layouts(parser, args.layouts)
    if args.from_json and not args.from_json.is_file():
        parser.error(f"--from-json {args.from_json}: no such file; give the bench.json of a modelpar-bench run")
    load_before = os.getloadavg()[0]
    peak = run_on_ranks(1, matmul_flops)[0]
    memory_bw = run_on_ranks(1, elementwise_bandwidth)[0]
    overhead = run_on_ranks(1, layer_overhead)[0]
    links = run_on_ranks(2, gloo_links)[0]
    in_loop = max(run_on_ranks(2, all_reduce_in_loop))
    if not priority_restorable():
        shutdown_pools()  # its socket threads stay idle without root or CAP_SYS_NICE: fresh workers for the rest
    slowdown = max(1.0, run_on_ranks(2, busy_slowdown)[0])
    bandwidth, isolated_latency = fit_ring(links["all_reduce_s"])
    # the planner's ring model for 2 ranks, 256 KiB: bytes/bw + 2 * latency; take the latency a tp step sees
    latency = max(isolated_latency, (in_loop - 262144 / bandwidth) / 2)
    p2p_ms = links["p2p_one_way_s"][262144] * 1e3
    print(
        f"calibrated: peak {peak / 1e9:.1f} GFLOP/s (1 thread fp32), gloo {bandwidth / 1e9:.2f} GB/s, "
        f"latency {latency * 1e6:.0f} us per ring step (isolated {isolated_latency * 1e6:.0f} us; 256 KiB all-reduce "
        f"in a matmul loop {in_loop * 1e3:.2f} ms); p2p 256 KiB one way {p2p_ms:.2f} ms; element-wise "
        f"{memory_bw / 1e9:.1f} GB/s; layer overhead {overhead * 1e3:.2f} ms; {os.cpu_count()} cores, "
        f"compute {slowdown:.2f}x slower with both busy"
    )
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        rows = {name: report["rows"][name] for name in args.layouts if name in report["rows"]}
    else:
        steps = f"{args.out.stem}_steps"  # the bench run behind it, beside it
        rows = bench_rows(args.layouts, args.rounds, args.passes, args.out.parent, steps)
        report = json.loads((args.out.parent / f"{steps}.json").read_text())
    hardware = dataclasses.replace(
        HARDWARE["cpu"],
        peak_flops=peak,
        intra_node_bw=bandwidth,
        inter_node_bw=bandwidth,
        latency_s=latency,
        memory_bw=memory_bw,
        layer_overhead_s=overhead,
        compute_units=os.cpu_count() or 1,
        busy_slowdown=slowdown,
    )
    model = model_spec(report)
    seq, batch = report["data"]["seq_len"], report["data"]["global_batch"]
    fitted = None
    if "single" in rows:
        # solve for the efficiency that makes the single-rank prediction exact: only the FLOP term scales with
        # it, the element-wise and per-layer overhead terms were measured above
        single = strategy_of(rows["single"], batch)
        shipped = predict(single, model, hardware, seq_len=seq)
        fixed = single.micro_batches * replicated_elementwise_s(model, single, seq, hardware)
        flop_s = shipped.compute_s - fixed
        efficiency = CostModel().efficiency * flop_s / max(rows["single"]["ours"]["step_s"] - fixed, 1e-9)
        fitted = CostModel(efficiency=min(1.0, efficiency))
    out_rows = []
    header = (
        f"{'layout':<22} {'ranks':>5} {'measured s':>10} {'plan s':>8} {'resid.':>7} {'plan (fit) s':>12} "
        f"{'resid.':>7}  parts of the fitted prediction (compute/tp/pp/dp/bubble s)"
    )
    print(header)
    for name, row in rows.items():
        strategy = strategy_of(row, batch)
        measured = row["ours"]["step_s"]
        default = predict(strategy, model, hardware, seq_len=seq)
        fit = predict(strategy, model, hardware, seq_len=seq, costs=fitted) if fitted else default
        entry = {
            "layout": name,
            "ranks": row["world_size"],
            "measured_step_s": measured,
            "predicted_step_s": default.total_s,
            "residual": default.total_s / measured - 1,
            "predicted_step_s_fitted": fit.total_s,
            "residual_fitted": fit.total_s / measured - 1,
            "fitted_parts_s": {
                k: getattr(fit, k) for k in ("compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s")
            },
            "ranks_exceed_cores": row["world_size"] > (os.cpu_count() or 1),
            "cpu_share": row["ours"].get("cpu_share"),
        }
        out_rows.append(entry)
        parts = "/".join(f"{v:.3f}" for v in entry["fitted_parts_s"].values())
        print(
            f"{name:<22} {entry['ranks']:>5} {measured:>10.3f} {default.total_s:>8.3f} {entry['residual']:>+7.1%} "
            f"{fit.total_s:>12.3f} {entry['residual_fitted']:>+7.1%}  {parts}"
        )
    result = {
        "calibration": {
            "peak_flops": peak,
            "gloo_bandwidth_Bps": bandwidth,
            "gloo_latency_s": latency,
            "all_reduce_s": links["all_reduce_s"],
            "native_all_reduce_s": links["native_all_reduce_s"],
            "elementwise_Bps": memory_bw,
            "layer_overhead_s": overhead,
            "all_reduce_256KiB_in_matmul_loop_s": in_loop,
            "gloo_latency_isolated_s": isolated_latency,
            "compute_units": os.cpu_count(),
            "busy_slowdown": slowdown,
            "p2p_one_way_s": links["p2p_one_way_s"],
            "fitted_efficiency": fitted.efficiency if fitted else None,
            "shipped_efficiency": CostModel().efficiency,
        },
        "model": dataclasses.asdict(model),
        "seq_len": seq,
        "global_batch": batch,
        "machine": {"cpus": os.cpu_count(), "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}},
        "rows": out_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Planner vs measured step time (CPU, gloo, one thread per rank)\n",
        f"Calibrated in the same run: peak {peak / 1e9:.1f} GFLOP/s, gloo {bandwidth / 1e9:.2f} GB/s, latency "
        f"{latency * 1e6:.0f} us (the engine's collectives inside a matmul loop), element-wise "
        f"{memory_bw / 1e9:.1f} GB/s, layer overhead {overhead * 1e3:.2f} ms, "
        f"{os.cpu_count()} cores shared by the ranks, compute {slowdown:.2f}x slower with more than one busy; "
        f"fitted efficiency {fitted.efficiency if fitted else float('nan'):.2f} "
        f"(shipped {CostModel().efficiency}).\n",
        "| layout | ranks | CPU share | measured s | planned s | residual | planned (fitted eff.) s | residual |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in out_rows:
        note = " (ranks > cores)" if e["ranks_exceed_cores"] else ""
        lines.append(
            f"| {e['layout']}{note} | {e['ranks']} | {e['cpu_share'] or float('nan'):.2f} | "
            f"{e['measured_step_s']:.3f} | {e['predicted_step_s']:.3f} | "
            f"{e['residual']:+.1%} | {e['predicted_step_s_fitted']:.3f} | {e['residual_fitted']:+.1%} |"
        )
    lines.append(
        "\nCPU share: process CPU seconds over wall seconds per rank (1.0 = a whole core); other jobs share the "
        "machine's cores. The planner is told the core count: layouts with more ranks than cores time-share them."
    )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    # Run as a script this file is __main__, which forkserver workers cannot import: re-import it by name.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import plan_vs_measured

    plan_vs_measured.main()
