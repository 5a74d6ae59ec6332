"""modelpar-train's data-parallel step against an independent plain-PyTorch peer, one run after the other.

    python benchmarks/peer_independent.py --peer PATH/peer_bench.py               # 3 layouts x 3 repeats
    python benchmarks/peer_independent.py --peer PATH/peer_bench.py --layouts single,zero0   # and one device
    python benchmarks/peer_independent.py --peer PATH/peer_bench.py --layouts zero0 --repeats 5 \
        --variants default,unpinned,bare

The peer is a stand-alone script (a GPT of bench-tiny's dimensions, 8 layers, hidden 256, 8 heads, vocab 4096,
batch 16 x 128, fp32, AdamW; ``DistributedDataParallel`` for ZeRO-0, FSDP2 ``fully_shard`` per block and at the
root for ZeRO-2 / ZeRO-3) that times 12 steps between barriers and takes the median after two warm-ups. Ours is
``modelpar-train model=bench-tiny parallel=single parallel.dp=2 optim.zero=Z`` (``ours_command``) with the same
batch, 12 steps, the median of ``metrics.jsonl``'s ``step_time_s`` after the same two warm-ups. Each repeat
runs, per layout, the peer and then every variant of ours back to back (seconds apart), so each ratio compares
runs under the same load; the reported ratio is the median over repeats of the per-repeat ratios (peer step
time over ours: > 1 is ours faster).

Variants of ours (``VARIANTS``): what a user gets (``default``), and the trainer's CPU-only or optional parts
switched off one group at a time, to show which of them the independent measurement pays for.

Writes ``benchmarks/results/peer_independent.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
# layout -> (the peer script's layout, its name, our layout's name, ZeRO stage, our overrides)
LAYOUTS = {
    "single": ("single_1t", "one process, one thread", "single", 0, ["parallel.dp=1"]),
    "zero0": ("dp2_ddp", "DDP", "dp2 zero0", 0, []),
    "zero2": ("dp2_fsdp2", "FSDP2 zero2", "dp2 zero2", 2, []),
    "zero3": ("dp2_fsdp3", "FSDP2 zero3", "dp2 zero3", 3, []),
}
# trainer overrides of each variant of ours
VARIANTS = {
    "default": [],
    # the CPU rank not bound to a core (the peer's processes float over the machine's cores)
    "unpinned": ["trainer.cpu_affinity=off"],
    # unpinned, plus the optional per-step work the peer's loop does not do switched off: the gradient-outlier
    # check (ZeRO-0/1 at dp >= 2), the periodic drift/straggler check, grad-norm clipping (0: measured only)
    "bare": [
        "trainer.cpu_affinity=off",
        "trainer.grad_outlier_action=off",
        "trainer.check_every=0",
        "optim.grad_clip=0",
    ],
}
STEPS, WARMUP = 12, 2


def children_cpu_s() -> float:
    """CPU seconds of every finished child process so far (user + system; their ranks included)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_peer(peer: Path, layout: str, timeout: int) -> dict:
    """One run of the peer script's layout; its median step (s), every step's time, the run's CPU seconds."""
    cpu = children_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(peer), "--only", layout, "--repeats", "1", "--timeout", str(timeout)]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout + 60)
        path = Path(tmp) / "peer_results.json"
        if proc.returncode or not path.is_file():
            raise RuntimeError(f"peer {layout} failed: {(proc.stdout + proc.stderr)[-400:]}")
        run = json.loads(path.read_text())["results"][0]["runs"][0]
    if run["status"] != "OK":
        raise RuntimeError(f"peer {layout}: {run['status']} {run.get('errors')}")
    return {
        "median_step_s": run["median_step_s"],
        "step_times_s": run["step_times_s"],
        "loss1": run["losses"][0],
        "cpu_s": children_cpu_s() - cpu,
    }


def ours_command(zero: int, overrides: list[str], out_dir: str) -> list[str]:
    """``modelpar-train`` at the peer's layout: data parallel over 2 ranks and nothing else (``parallel=single``:
    the default recipe's layout is tp2 x pp2), ZeRO ``zero``, the peer's batch and steps."""
    return [
        sys.executable,
        "-m",
        "modelpar.cli.train",
        "model=bench-tiny",
        "parallel=single",
        "parallel.dp=2",
        "parallel.microbatches=1",
        f"optim.zero={zero}",
        "data.global_batch=16",
        "data.seq_len=128",
        f"trainer.steps={STEPS}",
        "trainer.ckpt_every=0",
        "trainer.progress=false",
        f"trainer.log_every={STEPS}",
        f"trainer.out_dir={out_dir}",
        f"hydra.run.dir={out_dir}",
        *overrides,
    ]


def run_ours(zero: int, overrides: list[str], timeout: int) -> dict:
    """One ``modelpar-train`` run of bench-tiny at dp=2 and ZeRO ``zero``; its median step (s) after the warm-ups."""
    cpu = children_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            ours_command(zero, overrides, tmp), cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
        metrics = Path(tmp) / "metrics.jsonl"
        if proc.returncode or not metrics.is_file():
            raise RuntimeError(f"modelpar-train zero{zero} {overrides} failed: {(proc.stdout + proc.stderr)[-400:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["step_time_s"] for r in rows]
    return {
        "median_step_s": statistics.median(times[WARMUP:]),
        "step_times_s": times,
        "loss1": rows[0]["loss"],
        "cpu_s": children_cpu_s() - cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", type=Path, required=True, help="the peer script (peer_bench.py)")
    ap.add_argument("--layouts", default="zero0,zero2,zero3")
    ap.add_argument("--variants", default="default,unpinned,bare")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--out", default="peer_independent", help="result file stem under benchmarks/results")
    a = ap.parse_args()
    layouts, variants = a.layouts.split(","), a.variants.split(",")
    unknown = [x for x in layouts if x not in LAYOUTS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"peer_independent: unknown layout or variant {unknown}; try {list(LAYOUTS)} / {list(VARIANTS)}")
    runs: dict = {lay: {"peer": [], **{v: [] for v in variants}} for lay in layouts}
    started = time.time()
    for rep in range(a.repeats):
        for lay in layouts:
            peer = run_peer(a.peer.resolve(), LAYOUTS[lay][0], a.timeout)
            runs[lay]["peer"].append(peer)
            line = [f"[rep {rep}] {lay}: peer {peer['median_step_s']:.3f} s"]
            for v in variants:
                ours = run_ours(LAYOUTS[lay][3], LAYOUTS[lay][4] + VARIANTS[v], a.timeout)
                runs[lay][v].append(ours)
                line.append(f"{v} {ours['median_step_s']:.3f} s ({peer['median_step_s'] / ours['median_step_s']:.2f}x)")
            print(", ".join(line), f"[load {os.getloadavg()[0]:.1f}]", flush=True)
    rows = []
    for lay in layouts:
        peer_times = [r["median_step_s"] for r in runs[lay]["peer"]]
        for v in variants:
            ours = [r["median_step_s"] for r in runs[lay][v]]
            ratios = [p / o for p, o in zip(peer_times, ours, strict=True)]
            rows.append(
                {
                    "layout": LAYOUTS[lay][2],
                    "peer": LAYOUTS[lay][1],
                    "variant": v,
                    "overrides": VARIANTS[v],
                    "peer_step_s": peer_times,
                    "ours_step_s": ours,
                    "ratios": ratios,
                    "ratio": statistics.median(ratios),
                    "peer_tokens_per_s": 16 * 128 / statistics.median(peer_times),
                    "ours_tokens_per_s": 16 * 128 / statistics.median(ours),
                }
            )
    head = "| layout | peer | ours | peer s/step | ours s/step | ratio (median) | ratios per repeat |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        per = " / ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(
            f"| {r['layout']} | {r['peer']} | {r['variant']} | {statistics.median(r['peer_step_s']):.3f} | "
            f"{statistics.median(r['ours_step_s']):.3f} | {r['ratio']:.2f}x | {per} |"
        )
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "steps": STEPS,
        "warmup": WARMUP,
        "repeats": a.repeats,
        "seconds": round(time.time() - started),
        "cpus": os.cpu_count(),
        "rows": rows,
        "runs": runs,
    }
    (RESULTS / f"{a.out}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {RESULTS / a.out}.json")


if __name__ == "__main__":
    main()
