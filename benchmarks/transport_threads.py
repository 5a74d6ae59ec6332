"""gloo's socket threads at idle priority (``trainer.gloo_threads=idle``) against normal priority, step by step.

    python benchmarks/transport_threads.py                     # 7 layouts x 6 rounds, ~7 min on 2 cores
    python benchmarks/transport_threads.py --layouts tp2 --rounds 4
    python benchmarks/transport_threads.py --load 2 --name bench_gloo_threads_loaded   # beside 2 busy processes

For each layout the ranks build our ``Trainer`` and the layout's peer (DTensor TP, torch.distributed.pipelining
or DDP, ``modelpar.bench.peers``) once, bound to their cores as ``modelpar-bench`` binds them, and then
alternate inside the same processes: each round times one step of ours and one of the peer under each of
three settings (``MODES`` below; the order flips every round). Both sides of
every ratio are therefore seconds apart on the same workers, which is what makes a 5-10% effect visible on a
machine whose step times drift by 10-30% between runs. Each step is timed between barriers (the slowest
rank's time counts); the socket threads' own CPU time per step comes from ``/proc/self/task/*/schedstat``.
``--load N`` keeps N busy processes at normal priority running throughout: another job, a test worker, a browser
on the same machine.

Writes ``benchmarks/results/bench_gloo_threads.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from modelpar.cli.args import check_layouts, positive_int

RESULTS = Path(__file__).resolve().parent / "results"
# policy: what the trainer does (its tp group's socket threads idle when tp > 1) and what modelpar-bench gives
# the peer (all its socket threads idle when tp > 1); all: every socket thread idle; normal: none
MODES = ("policy", "all", "normal")


def socket_thread_cpu_s() -> float:
    """CPU seconds used so far by this process's gloo socket threads."""
    from modelpar.backends.gloo_cpu import gloo_socket_threads

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
    from modelpar.backends.gloo_cpu import pinned, set_gloo_threads
    from modelpar.bench.harness import peer_socket_threads
    from modelpar.bench.peers import Peer, peer_name
    from modelpar.data import WindowSampler
    from modelpar.training.build import build_partition
    from modelpar.training.trainer import Trainer

    try:
        with pinned(dist.get_rank(), 1, enabled=cfg.trainer.cpu_affinity == "auto"):
            trainer = Trainer(cfg, data_path, None)
            sides = {"ours": lambda: trainer.train_step().loss}
            policy = {"ours": set(trainer.idle_threads), "peer": set()}
            if peer_name(cfg) is not None:
                peer = Peer(cfg, cfg.model, build_partition(cfg), trainer.device)
                if trainer.idle_threads:
                    policy["peer"] = peer_socket_threads(trainer)
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
                    for side, fn in sides.items():
                        set_gloo_threads("normal")
                        if mode != "normal":
                            set_gloo_threads("idle", None if mode == "all" else policy[side])
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
    from modelpar.bench.layout_spec import layout_name, parse_layout
    from modelpar.testing import run_on_ranks
    from modelpar.training.config import validate

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
        "speedup_over_normal": {
            f"{side}/{mode}": median[f"{side}/normal"] / median[f"{side}/{mode}"]
            for side in ("ours", "peer")
            for mode in MODES[:2]
            if f"{side}/{mode}" in median
        },
    }
    if "peer/normal" in median:
        row["ours_over_peer"] = {mode: median[f"peer/{mode}"] / median[f"ours/{mode}"] for mode in MODES}
    return row


def markdown(rows: list[dict], rounds: int, load: int = 0) -> str:
    beside = f", beside {load} busy processes" if load else ""
    lines = [
        f"# gloo socket threads at idle vs normal priority (bench-tiny, 2 cores, alternating steps{beside})\n",
        "| layout | ranks | ours tok/s policy / all idle / normal | ours speedup policy, all idle | peer "
        "| peer tok/s policy / all idle / normal | peer speedup policy, all idle | ours/peer policy / all / normal "
        "| socket-thread CPU ms/step, ours policy / all / normal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def three(d: dict, side: str, fmt: str) -> str:
        return " / ".join(format(d[f"{side}/{m}"], fmt) for m in MODES)

    for r in rows:
        t, s, up = r["tokens_per_s"], r["socket_thread_cpu_ms_per_step"], r["speedup_over_normal"]
        if r["peer"]:
            o = r["ours_over_peer"]
            peer_cols = (
                f"{r['peer']} | {three(t, 'peer', ',.0f')} | {up['peer/policy']:.2f}x, {up['peer/all']:.2f}x | "
                + " / ".join(f"{o[m]:.2f}x" for m in MODES)
            )
        else:
            peer_cols = "- | - | - | -"
        lines.append(
            f"| {r['layout']} | {r['ranks']} | {three(t, 'ours', ',.0f')} | "
            f"{up['ours/policy']:.2f}x, {up['ours/all']:.2f}x | {peer_cols} | {three(s, 'ours', '.0f')} |"
        )
    lines.append(
        f"\nMedian of {rounds} steps per cell; every round runs ours and the peer under all three settings in the same "
        "worker processes (order flipping each round), each step timed between barriers. policy: "
        "`trainer.gloo_threads=idle`: our tensor-parallel group's socket threads idle when tp > 1, and the "
        "peer's socket threads, all of them, idle when tp > 1 (as `modelpar-bench` runs it); all: every socket "
        "thread idle; normal: none. Socket-thread CPU: time on CPU of the `gloo_tcp_loop` threads during one "
        "step, median over ranks and steps."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["tp2", "tp2-pp2-1f1b", "pp2-1f1b", "pp2-vpp2-interleaved", "pp2-gpipe", "pp2-zb-h1", "dp2"],
    )
    parser.add_argument("--rounds", type=positive_int, default=6)
    parser.add_argument("--name", default="bench_gloo_threads")
    parser.add_argument("--load", type=int, default=0, help="busy processes at normal priority beside the run")
    args = parser.parse_args()
    check_layouts(parser, args.layouts)
    from modelpar.backends.gloo_cpu import priority_restorable

    if not priority_restorable():
        raise SystemExit(
            "transport_threads.py: switching gloo's socket threads back to normal priority needs root or "
            "CAP_SYS_NICE; rerun with them (e.g. sudo), or compare two modelpar-bench runs with "
            "trainer.gloo_threads=idle and =normal instead"
        )
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.bench.config import register_bench_schema
    from modelpar.training.preflight import resolve_data

    register_bench_schema()
    recipes = Path(__file__).resolve().parent.parent / "recipes"
    with initialize_config_dir(config_dir=str(recipes), version_base="1.3"):
        # the policy measured is trainer.gloo_threads=idle (opt-in): the trainer idles its tp threads under it
        overrides = ["trainer.out_dir=runs/bench-gloo-threads", "trainer.progress=false", "trainer.gloo_threads=idle"]
        base = OmegaConf.to_object(compose(config_name="bench", overrides=overrides))
    data_path, _ = resolve_data(base)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(args.load, 0))]
    rows = []
    try:
        for layout in args.layouts:
            row = run_layout(base, layout, str(data_path), args.rounds)
            rows.append(row)
            print(
                f"{row['layout']}: "
                + ", ".join(f"{k} {v:.2f}x of normal" for k, v in row["speedup_over_normal"].items()),
                flush=True,
            )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    text = markdown(rows, args.rounds, args.load)
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0], "busy_processes_beside": args.load}
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
