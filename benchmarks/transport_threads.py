"""gloo's socket threads at idle priority (``trainer.gloo_threads=idle``) against normal priority, step by step.

    python benchmarks/transport_threads.py                     # 4 layouts x 8 rounds, ~6 min on 2 cores
    python benchmarks/transport_threads.py --layouts tp2 --rounds 4

For each layout the ranks build our ``Trainer`` and the layout's peer (DTensor TP, torch.distributed.pipelining
or DDP, ``modelpar.bench_peers``) once, bound to their cores as ``modelpar-bench`` binds them, and then
alternate inside the same processes: each round times one step of ours and one of the peer with the socket
threads idle, and one of each with them normal (the order of the two modes flips every round). Both sides of
every ratio are therefore seconds apart on the same workers, which is what makes a 5-10% effect visible on a
machine whose step times drift by 10-30% between runs. Each step is timed between barriers (the slowest
rank's time counts); the socket threads' own CPU time per step comes from ``/proc/self/task/*/schedstat``.

Writes ``benchmarks/results/bench_gloo_threads.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("idle", "normal")


def socket_thread_cpu_s() -> float:
    """CPU seconds used so far by this process's gloo socket threads."""
    from modelpar.affinity import gloo_socket_threads

    total = 0
    for tid in gloo_socket_threads():
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            continue
    return total / 1e9


def rank_ab(cfg, data_path: str, rounds: int) -> dict:
    """One rank: ``rounds`` x (ours and the peer under both modes), in alternating order."""
    from modelpar.affinity import pinned, set_gloo_threads
    from modelpar.bench_peers import Peer, peer_name
    from modelpar.data import WindowSampler
    from modelpar.trainer import Trainer, build_partition, transformer_config

    try:
        with pinned(dist.get_rank(), 1, enabled=cfg.trainer.cpu_affinity == "auto"):
            trainer = Trainer(cfg, data_path, None)
            sides = {"ours": lambda: trainer.train_step().loss}
            if peer_name(cfg) is not None:
                peer = Peer(cfg, transformer_config(cfg), build_partition(cfg), trainer.device)
                sampler = WindowSampler(
                    trainer.tokens.num_windows,
                    cfg.data.global_batch,
                    trainer.groups.dp_rank,
                    trainer.layout.dp,
                    cfg.data.seed,
                )

                def theirs() -> float:
                    inputs, targets = trainer.tokens.batch(sampler.next_batch())
                    return peer.step(inputs, targets)

                sides["peer"] = theirs
            for fn in sides.values():  # warm-up
                fn()
            times = {f"{side}/{mode}": [] for side in sides for mode in MODES}
            socket_cpu = {f"{side}/{mode}": [] for side in sides for mode in MODES}
            for k in range(rounds):
                for mode in MODES if k % 2 == 0 else MODES[::-1]:
                    set_gloo_threads(mode)
                    for side, fn in sides.items():
                        dist.barrier()
                        cpu = socket_thread_cpu_s()
                        start = time.perf_counter()
                        fn()
                        times[f"{side}/{mode}"].append(time.perf_counter() - start)
                        socket_cpu[f"{side}/{mode}"].append(socket_thread_cpu_s() - cpu)
            return {"times": times, "socket_cpu": socket_cpu, "peer": peer_name(cfg)}
    finally:
        set_gloo_threads("normal")


def run_layout(base, layout: str, data_path: str, rounds: int) -> dict:
    from modelpar.bench import layout_name, parse_layout
    from modelpar.config import validate
    from modelpar.testing import run_on_ranks

    case = replace(base, parallel=parse_layout(layout, base.parallel))
    case.trainer.steps = 10 * rounds + 10
    validate(case)
    world = case.parallel.layout().world_size
    per_rank = run_on_ranks(world, rank_ab, case, data_path, rounds, timeout_s=1800)
    keys = per_rank[0]["times"].keys()
    step = {k: [max(r["times"][k][i] for r in per_rank) for i in range(rounds)] for k in keys}
    median = {k: statistics.median(v) for k, v in step.items()}
    socket_ms = {k: 1e3 * statistics.median([c for r in per_rank for c in r["socket_cpu"][k]]) for k in keys}
    tokens = base.data.global_batch * base.data.seq_len
    row = {
        "layout": layout_name(case.parallel),
        "ranks": world,
        "peer": per_rank[0]["peer"],
        "step_s": step,
        "median_step_s": median,
        "tokens_per_s": {k: tokens / v for k, v in median.items()},
        "socket_thread_cpu_ms_per_step": socket_ms,
        "idle_speedup": {
            side: median[f"{side}/normal"] / median[f"{side}/idle"]
            for side in ("ours", "peer")
            if f"{side}/idle" in median
        },
    }
    if "peer/idle" in median:
        row["ours_over_peer"] = {mode: median[f"peer/{mode}"] / median[f"ours/{mode}"] for mode in MODES}
    return row


def markdown(rows: list[dict], rounds: int) -> str:
    lines = [
        "# gloo socket threads at idle vs normal priority (bench-tiny, 2 cores, alternating steps)\n",
        "| layout | ranks | ours tok/s idle / normal | ours idle speedup | peer | peer tok/s idle / normal "
        "| peer idle speedup | ours/peer idle | ours/peer normal | socket-thread CPU ms/step, ours idle / normal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, s = r["tokens_per_s"], r["socket_thread_cpu_ms_per_step"]
        peer = r["peer"] or "-"
        if r["peer"]:
            peer_cols = (
                f"{t['peer/idle']:,.0f} / {t['peer/normal']:,.0f} | {r['idle_speedup']['peer']:.2f}x | "
                f"{r['ours_over_peer']['idle']:.2f}x | {r['ours_over_peer']['normal']:.2f}x"
            )
        else:
            peer_cols = "- | - | - | -"
        lines.append(
            f"| {r['layout']} | {r['ranks']} | {t['ours/idle']:,.0f} / {t['ours/normal']:,.0f} | "
            f"{r['idle_speedup']['ours']:.2f}x | {peer} | {peer_cols} | "
            f"{s['ours/idle']:.0f} / {s['ours/normal']:.0f} |"
        )
    lines.append(
        f"\nMedian of {rounds} steps per cell; every round runs ours and the peer under both modes in the same "
        "worker processes (order flipping each round), each step timed between barriers. Socket-thread CPU: "
        "time on CPU of the `gloo_tcp_loop` threads during one step, median over ranks and steps."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["tp2", "tp2-pp2-1f1b", "pp2-1f1b", "dp2"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--name", default="bench_gloo_threads")
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.bench import register_bench_schema
    from modelpar.train import resolve_data

    register_bench_schema()
    recipes = Path(__file__).resolve().parent.parent / "recipes"
    with initialize_config_dir(config_dir=str(recipes), version_base="1.3"):
        overrides = ["trainer.out_dir=runs/bench-gloo-threads", "trainer.progress=false"]
        base = OmegaConf.to_object(compose(config_name="bench", overrides=overrides))
    data_path, _ = resolve_data(base)
    rows = []
    for layout in args.layouts:
        row = run_layout(base, layout, str(data_path), args.rounds)
        rows.append(row)
        print(
            f"{row['layout']}: ours idle {row['idle_speedup']['ours']:.2f}x faster"
            + (f", peer {row['idle_speedup']['peer']:.2f}x" if "peer" in row["idle_speedup"] else ""),
            flush=True,
        )
    text = markdown(rows, args.rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0]}
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({"rounds": args.rounds, "machine": machine, "rows": rows}, indent=1) + "\n"
    )
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    # Run as a script this file is __main__, which the rank workers cannot import: import it by name so that
    # run_on_ranks can pickle rank_ab.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import transport_threads

    transport_threads.main()
