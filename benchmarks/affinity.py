"""Ranks bound to their own cores (``trainer.cpu_affinity=auto``) against unbound ranks, pair by pair.

    python benchmarks/affinity.py                  # 3 pairs of modelpar-bench runs (~8 min on 2 cores)
    python benchmarks/affinity.py --pairs 1 --layouts tp2-pp2-1f1b

Each pair runs ``modelpar-bench`` (ours only) with ``trainer.cpu_affinity=auto`` and then ``off`` on the same
layouts, so the two sides of a ratio are minutes apart; the order alternates between pairs. Writes
``benchmarks/results/bench_affinity.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from modelpar.cli.args import check_layouts, positive_int

RESULTS = Path(__file__).resolve().parent / "results"


def bench(layouts: list[str], affinity: str, out: Path) -> dict[str, float]:
    """tokens/s per layout of one ``modelpar-bench`` run."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "modelpar.cli.bench",
            f"bench.sweep=[{','.join(layouts)}]",
            "bench.peer=false",
            f"trainer.cpu_affinity={affinity}",
            f"bench.results_dir={out}",
            f"bench.name=affinity_{affinity}",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = json.loads((out / f"affinity_{affinity}.json").read_text())["rows"]
    return {name: row["ours"]["tokens_per_s"] for name, row in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["tp2-pp2-1f1b", "tp2", "pp2-1f1b"])
    parser.add_argument("--pairs", type=positive_int, default=3)
    args = parser.parse_args()
    check_layouts(parser, args.layouts)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            order = ("auto", "off") if k % 2 == 0 else ("off", "auto")
            pair = {mode: bench(args.layouts, mode, Path(tmp)) for mode in order}
            runs.append(pair)
            print(
                f"pair {k + 1}/{args.pairs}: "
                + ", ".join(f"{n} {pair['auto'][n] / pair['off'][n]:.2f}x" for n in args.layouts)
            )
    table = {
        name: {
            "pinned_tokens_per_s": [r["auto"][name] for r in runs],
            "unpinned_tokens_per_s": [r["off"][name] for r in runs],
            "ratios": [r["auto"][name] / r["off"][name] for r in runs],
        }
        for name in args.layouts
    }
    lines = [
        "# Ranks bound to their own cores vs unbound (bench-tiny, ours only, one thread per rank)\n",
        "| layout | pinned tok/s | unpinned tok/s | pinned / unpinned per pair | median |",
        "|---|---|---|---|---|",
    ]
    for name, t in table.items():
        lines.append(
            f"| {name} | {', '.join(f'{v:,.0f}' for v in t['pinned_tokens_per_s'])} | "
            f"{', '.join(f'{v:,.0f}' for v in t['unpinned_tokens_per_s'])} | "
            f"{', '.join(f'{v:.2f}x' for v in t['ratios'])} | {statistics.median(t['ratios']):.2f}x |"
        )
    lines.append(
        "\nEach pair: one `modelpar-bench` run with `trainer.cpu_affinity=auto`, one with `off`, back to back "
        "(order alternating). tp2 x pp2 runs 4 ranks on the 2 cores."
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_affinity.json").write_text(json.dumps({"pairs": args.pairs, "layouts": table}, indent=1) + "\n")
    (RESULTS / "bench_affinity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
