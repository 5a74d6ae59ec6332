"""How CPU ranks start: forked from a server that imported torch and the engine once, or spawned as fresh
interpreters that each import them again (``MODELPAR_RANK_START=spawn``).

    python benchmarks/rank_start.py                      # worlds 2, 4, 8; 3 rounds; both ways alternated
    python benchmarks/rank_start.py --worlds 8 --rounds 5

Each run is a whole ``modelpar-train`` of the tiny model for one step (dp = world, no checkpoint), timed from
the command's start to its exit: what a user waits for, and what each of the test suite's end-to-end runs
costs. The two ways run one after the other inside each round, so a busy machine slows both alike. Every run
must end with the same step-1 loss. Writes ``benchmarks/results/rank_start.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("spawn", "forkserver")


def run_once(world: int, method: str, tokens: Path) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "modelpar.cli.train",
            "model=tiny",
            "parallel=single",
            f"parallel.dp={world}",
            f"data.global_batch={2 * world}",
            f"data.path={tokens}",
            "data.seq_len=32",
            "trainer.steps=1",
            "trainer.ckpt_every=0",
            "trainer.sample_tokens=0",
            f"hydra.run.dir={out}",
        ]
        started = time.perf_counter()
        done = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "MODELPAR_RANK_START": method}, timeout=600
        )
        seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{method} at world {world} failed:\n{done.stderr[-2000:]}")
    loss = re.search(r"loss (\d+\.\d+)", done.stdout + done.stderr)
    return seconds, loss.group(1) if loss else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import numpy as np

    rows = []
    with tempfile.TemporaryDirectory() as data:
        tokens = Path(data) / "tokens.npy"
        np.save(tokens, np.random.default_rng(0).integers(0, 64, size=20_000, dtype=np.uint16))
        for world in args.worlds:
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            losses = set()
            for _ in range(args.rounds):
                for method in METHODS:
                    seconds, loss = run_once(world, method, tokens)
                    times[method].append(seconds)
                    losses.add(loss)
            if len(losses) != 1:
                raise SystemExit(f"world {world}: the two ways trained to different losses {sorted(losses)}")
            row = {"world": world, "loss_step_1": losses.pop()}
            for method in METHODS:
                row[method] = {"min_s": min(times[method]), "median_s": statistics.median(times[method])}
            row["spawn_over_forkserver"] = row["spawn"]["median_s"] / row["forkserver"]["median_s"]
            rows.append(row)
            print(
                f"world {world}: spawn {row['spawn']['median_s']:.1f} s, forkserver {row['forkserver']['median_s']:.1f}"
                f" s (median of {args.rounds}): {row['spawn_over_forkserver']:.2f}x",
                flush=True,
            )
    report = {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
        "rounds": args.rounds,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rank_start.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Rank start: fork server against spawn",
        "",
        f"`python benchmarks/rank_start.py`, {report['date']}, {report['cpus']} CPUs, load {report['load_before']:.1f} "
        f"at the start; a one-step `modelpar-train` of the tiny model at dp = world, median of {args.rounds} rounds, "
        "the two ways alternated.",
        "",
        "| ranks | spawn (s) | fork server (s) | spawn / fork server | step-1 loss (both) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['spawn']['median_s']:.1f} | {r['forkserver']['median_s']:.1f} | "
            f"{r['spawn_over_forkserver']:.2f}x | {r['loss_step_1']} |"
        )
    (args.out / "rank_start.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
