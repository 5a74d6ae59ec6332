"""FP8 GEMMs on CPU: torch's ``_scaled_mm`` with one scale per tensor (``model.fp8=tensorwise``) against the same
product with that scale passed as a row and a column (``modelpar.backends.cpu_fp8``, what a CPU rank runs), and
against a scale per row and column (``model.fp8=rowwise``). One process, one thread; the three alternate round by
round, the median of the rounds counts.

Shapes: the forward, input-gradient and weight-gradient GEMMs of the test models' MLP (hidden 32, 40 wide, 64
tokens) and of bench-tiny's up-projection (hidden 256, 2 x 688 wide, 256 tokens) and attention output (256 x 256).

    python benchmarks/cpu_fp8_gemm.py [--rounds 3]

Writes ``benchmarks/results/cpu_fp8_gemm.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from modelpar.backends.cpu_fp8 import scaled_mm
from modelpar.model.layers.fp8 import FP8

RESULTS = Path(__file__).resolve().parent / "results"
# (name, M, K, N) of a @ b.T with a: [M, K], b: [N, K]
SHAPES = [
    ("tiny mlp forward", 64, 32, 48),
    ("tiny mlp input grad", 64, 48, 32),
    ("tiny mlp weight grad", 48, 64, 32),
    ("bench-tiny up forward", 256, 256, 1376),
    ("bench-tiny up input grad", 256, 1376, 256),
    ("bench-tiny up weight grad", 1376, 256, 256),
    ("bench-tiny attn out forward", 256, 256, 256),
]


def _operands(m: int, k: int, n: int):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    b = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    return a, b.t()


def _ways(m: int, n: int) -> dict:
    scalar_a, scalar_b = torch.tensor(0.01), torch.tensor(0.02)
    return {
        "torch, per tensor": (torch._scaled_mm, scalar_a, scalar_b),
        "modelpar CPU, per tensor": (scaled_mm, scalar_a, scalar_b),
        "torch, per row": (torch._scaled_mm, torch.full((m, 1), 0.01), torch.full((1, n), 0.02)),
    }


def time_shape(m: int, k: int, n: int, rounds: int) -> dict[str, float]:
    a, b = _operands(m, k, n)
    ways = _ways(m, n)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name in list(ways)[:: 1 if r % 2 == 0 else -1]:
            gemm, sa, sb = ways[name]
            t = time.perf_counter()
            gemm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    torch.set_num_threads(1)
    first = _operands(16, 16, 16)  # torch's first call of each kind pays its set-up outside the rounds
    for gemm, sa, sb in _ways(16, 16).values():
        gemm(*first, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    rows = []
    for name, m, k, n in SHAPES:
        t = time_shape(m, k, n, a.rounds)
        ours, torchs = t["modelpar CPU, per tensor"], t["torch, per tensor"]
        rows.append({"gemm": name, "m": m, "k": k, "n": n, "seconds": t, "speedup": torchs / ours})
    lines = [
        f"# FP8 GEMMs on CPU (`benchmarks/cpu_fp8_gemm.py --rounds {a.rounds}`), one thread, median ms",
        "",
        "| GEMM | M x K x N | torch, per tensor | modelpar CPU, per tensor | torch, per row | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["seconds"]
        lines.append(
            f"| {r['gemm']} | {r['m']} x {r['k']} x {r['n']} | {s['torch, per tensor'] * 1e3:.2f} | "
            f"{s['modelpar CPU, per tensor'] * 1e3:.3f} | {s['torch, per row'] * 1e3:.3f} | {r['speedup']:.0f}x |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_fp8_gemm.json").write_text(json.dumps({"rounds": a.rounds, "rows": rows}, indent=1) + "\n")
    (RESULTS / "cpu_fp8_gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
