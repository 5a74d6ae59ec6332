"""The four context-parallel exchanges side by side: ring, all-gather, all-to-all (Ulysses) and hybrid.

    python benchmarks/cp_comm.py                        # cp4, seq 4096, bench-tiny at 2 layers: a few minutes
    python benchmarks/cp_comm.py --cp 2 --modes ring allgather alltoall
    python benchmarks/cp_comm.py --set model.layers=8 --steps 3         # any recipe override

Each mode trains the same recipe (``recipes/bench.yaml``, by default ``model=bench-tiny`` with 2 layers, one
sequence of 4096 tokens per step, one micro-batch) on ``cp`` gloo ranks, one thread each: a warm-up step, then
``--steps`` steps timed between barriers (the slowest rank counts, median over steps), then one step with the
collective counter on (``modelpar.parallel.collectives.record_comm``). Hybrid uses ``--a2a`` (default 2)
consecutive cp ranks per all-to-all group and a ring across the groups.

Bytes per step and rank of attention's exchange (recompute off), per layer per micro-batch, from the shapes
(``e = b * s/cp * d`` elements of one head of this rank's tokens, ``w`` bytes per element, K/V gradients fp32):

    ring       forward cp-1 K/V blocks (2*hkv*e), backward cp-1 K/V blocks and cp dK/dV blocks
    allgather  forward all-gather of K/V (cp x 2*hkv*e gathered), backward the same and a reduce-scatter of dK/dV
    alltoall   forward q, k, v (hkv repeated r times, r = n/gcd(hkv, n)) to heads and o back: (2*hq + 2*r*hkv)*e,
               backward the same again; (n-1)/n of it leaves the rank
    hybrid     the all-to-all over n = a2a ranks, then the ring of cp/n ranks on n*e-token blocks of r*hkv/n heads

"counted" is what the counter records (a send's bytes; an all-gather's gathered output; a reduce-scatter's and
an all-to-all's input, the rank's own share included), checked against the counter; "sent" is what leaves the
rank. Writes ``benchmarks/results/cp_comm.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = Path(__file__).resolve().parent.parent / "recipes"
MODES = ("ring", "allgather", "alltoall", "hybrid")
EXCHANGES = ("send_recv", "all_gather", "reduce_scatter", "all_to_all")  # attention's; all_reduce is the grads'


def rank_steps(cfg, data_path: str, steps: int) -> dict:
    """One rank: a warm-up step, ``steps`` timed steps, one counted step."""
    from modelpar.backends.gloo_cpu import pinned
    from modelpar.parallel.collectives import record_comm
    from modelpar.training.trainer import Trainer

    with pinned(dist.get_rank(), 1, enabled=cfg.trainer.cpu_affinity == "auto"):
        trainer = Trainer(cfg, data_path, None)
        trainer.train_step()
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)
        with record_comm() as log:
            trainer.train_step()
    counted = {kind: log.total_bytes(kind) for kind in EXCHANGES}
    return {"times": times, "counted": counted, "calls": {kind: log.count(kind) for kind in EXCHANGES}}


def _ring_bytes(cp: int, kv_block: float, grad_block: float) -> dict[str, float]:
    sends = (cp - 1) * kv_block + (cp - 1) * kv_block + cp * grad_block
    return {"send_recv": sends}


def analytic_bytes(cfg, mode: str, a2a: int) -> tuple[dict[str, float], float]:
    """(counted bytes per kind, bytes sent) per step on one rank, attention's exchange only (module docstring)."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    cp, w = p.cp, 4  # fp32 training
    hq, hkv, hd = m.heads // p.tp, max(1, m.kv_heads // p.tp), m.hidden // m.heads
    e = d.global_batch // p.dp // p.microbatches * d.seq_len // cp * hd  # one head of this rank's tokens
    per_layer: dict[str, float] = {}
    sent = 0.0
    n = cp if mode == "alltoall" else a2a if mode == "hybrid" else 1
    if n > 1:
        r = n // math.gcd(hkv, n)
        moved = 2 * (2 * hq + 2 * r * hkv) * e * w
        per_layer["all_to_all"] = moved
        sent += moved * (n - 1) / n
        ring, block_e, ring_kv = cp // n, n * e, r * hkv // n
    else:
        ring, block_e, ring_kv = cp, e, hkv
    if mode == "allgather":
        gathered = cp * 2 * hkv * e * w
        per_layer |= {"all_gather": 2 * gathered, "reduce_scatter": gathered}
        sent += 3 * gathered * (cp - 1) / cp
    elif ring > 1:
        kv_block = 2 * ring_kv * block_e * w
        per_layer |= _ring_bytes(ring, kv_block, 2 * ring_kv * block_e * 4)
        sent += per_layer["send_recv"]
    layers = m.layers * p.microbatches
    return {kind: layers * per_layer.get(kind, 0.0) for kind in EXCHANGES}, layers * sent


def mode_config(base, mode: str, cp: int, a2a: int):
    from modelpar.training.config import validate

    parallel = replace(base.parallel, cp=cp, cp_comm=mode, cp_a2a=a2a if mode == "hybrid" else 0)
    cfg = replace(base, parallel=parallel, trainer=replace(base.trainer, steps=100))
    validate(cfg)
    return cfg


def run_mode(cfg, data_path: str, steps: int, a2a: int) -> dict:
    from modelpar.testing import run_on_ranks

    mode = cfg.parallel.cp_comm
    per_rank = run_on_ranks(cfg.parallel.cp, rank_steps, cfg, data_path, steps, timeout_s=3600)
    step = statistics.median(max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True))
    counted, sent = analytic_bytes(cfg, mode, a2a)
    measured = per_rank[0]["counted"]
    return {
        "mode": mode + (f"-a2a{a2a}" if mode == "hybrid" else ""),
        "cp": cfg.parallel.cp,
        "step_s": step,
        "tokens_per_s": cfg.data.global_batch * cfg.data.seq_len / step,
        "counted_bytes": counted,
        "measured_bytes": measured,
        "calls": per_rank[0]["calls"],
        "counter_agrees": all(abs(counted[k] - measured[k]) <= 1e-6 * max(1.0, counted[k]) for k in EXCHANGES),
        "sent_bytes": sent,
    }


def markdown(rows: list[dict], meta: dict) -> str:
    mib = 2**20
    lines = [
        f"# Context-parallel exchanges: cp{meta['cp']}, seq {meta['seq_len']}, {meta['model']}",
        "",
        "| mode | tokens/s | step s | counted MiB/step/rank (by kind) | counter agrees | sent MiB/step/rank |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        kinds = ", ".join(f"{k} {v / mib:.1f}" for k, v in r["counted_bytes"].items() if v)
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.2f} | {kinds} | "
            f"{'yes' if r['counter_agrees'] else 'NO'} | {r['sent_bytes'] / mib:.1f} |"
        )
    lines += [
        "",
        f"{meta['steps']} timed steps per mode after a warm-up step, median of the slowest rank; batch "
        f"{meta['global_batch']} x {meta['seq_len']}, {meta['layers']} layers, {meta['heads']} heads / "
        f"{meta['kv_heads']} kv heads, fp32, gloo on loopback, one thread per rank, {meta['cpus']} CPUs, "
        f"1-minute load average {meta['load_average_1min']:.1f} at the end. counted: the analytic bytes by the "
        "collective counter's convention (sends; all-gather output; reduce-scatter and all-to-all input), "
        "equal to the counter's where 'counter agrees'; sent: the bytes that leave the rank.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="cp_comm.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--a2a", type=int, default=2, help="hybrid: cp ranks per all-to-all group")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per mode")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    ap.add_argument("--name", default="cp_comm", help="results file stem")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.bench.config import register_bench_schema

    register_bench_schema()
    tmp = Path(tempfile.mkdtemp(prefix="cp-comm-"))
    overrides = [
        "model=bench-tiny",
        "model.layers=2",
        f"model.max_seq_len={args.seq_len}",
        f"data.seq_len={args.seq_len}",
        "data.global_batch=1",
        "parallel.microbatches=1",
        f"trainer.out_dir={tmp / 'run'}",
        "trainer.progress=false",
        "trainer.ckpt_every=0",
        "trainer.sample_tokens=0",
        *args.set,
    ]
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        base = OmegaConf.to_object(compose(config_name="bench", overrides=overrides))
    try:
        cases = [mode_config(base, mode, args.cp, args.a2a) for mode in args.modes]
    except ValueError as exc:  # RecipeError: before any rank starts
        ap.error(str(exc).splitlines()[0])
    tokens = tmp / "tokens.npy"
    windows = 16 * base.data.global_batch * base.data.seq_len
    np.save(tokens, np.random.default_rng(0).integers(0, base.model.vocab_size, size=windows, dtype=np.uint16))
    torch.set_num_threads(1)
    rows = []
    for cfg in cases:
        row = run_mode(cfg, str(tokens), args.steps, args.a2a)
        rows.append(row)
        print(f"{row['mode']}: {row['tokens_per_s']:,.0f} tokens/s", flush=True)
    m = base.model
    meta = {
        "cp": args.cp, "seq_len": args.seq_len, "model": f"{m.name} ({m.layers} layers, hidden {m.hidden})",
        "layers": m.layers, "heads": m.heads, "kv_heads": m.kv_heads, "global_batch": base.data.global_batch,
        "steps": args.steps, "overrides": args.set, "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
    }  # fmt: skip
    text = markdown(rows, meta)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (args.results_dir / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    # Run as a script this file is __main__, which the rank workers cannot import: import it by name so that
    # run_on_ranks can pickle rank_steps.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cp_comm

    cp_comm.main()
