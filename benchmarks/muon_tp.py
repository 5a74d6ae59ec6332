"""Gather or distribute? Newton-Schulz of tp-sharded matrices at tp2, both ways, on two CPU ranks.

    python benchmarks/muon_tp.py                 # bench-tiny's matrices and a wider model's, bf16 and fp32
    python benchmarks/muon_tp.py --repeats 5

The matrices are one model's tp-sharded Muon matrices as tp2 splits them (q, k, v, gate, up by rows; o and down
by columns), ``--layers`` layers of them: bench-tiny (hidden 256, ffn 688) and a wider one (hidden 512, ffn
1376). Timed per step of all of them, on every rank (the max over the two ranks, the median over repeats):

- gather: the engine's exchange (``modelpar.optim.muon_exchange``): each shard to its matrix's owner (owners
  balanced by Newton-Schulz FLOPs), Newton-Schulz whole there, the results back; two all-to-alls;
- distributed: ``modelpar.optim.muon_tp.newton_schulz_sharded`` on every matrix on both ranks, its Gram
  matrices all-reduced (``ns_steps`` all-reduces and one of the norm per matrix).

Results: ``benchmarks/results/muon_tp.json`` and ``muon_tp.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"bench-tiny (h256, ffn688)": (256, 688, 8), "wider (h512, ffn1376)": (512, 1376, 2)}


def _matrices(hidden: int, ffn: int, layers: int) -> list[tuple[tuple[int, int], int]]:
    """(shape, split dim) of each tp-sharded Muon matrix (q, k, v, o, gate, up, down of every layer)."""
    layer = [((hidden, hidden), 0)] * 3 + [((hidden, hidden), 1), ((ffn, hidden), 0), ((ffn, hidden), 0)]
    return (layer + [((hidden, ffn), 1)]) * layers


def timed_rank(hidden: int, ffn: int, layers: int, ns_dtype: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from modelpar.optim.muon import MuonSettings, newton_schulz, newton_schulz_flops
    from modelpar.optim.muon_exchange import MatrixTable, route
    from modelpar.optim.muon_tp import newton_schulz_sharded
    from modelpar.parallel import collectives

    torch.manual_seed(0)
    settings, rank, tp = MuonSettings(ns_dtype=ns_dtype), dist.get_rank(), dist.get_world_size()
    mats = _matrices(hidden, ffn, layers)
    loads, owners, starts, offset = [0] * tp, [], [], 0
    for shape, _ in mats:
        owner = min(range(tp), key=lambda r: (loads[r], r))
        loads[owner] += newton_schulz_flops(shape, settings.ns_steps)
        owners.append(owner)
        starts.append(offset)
        offset += shape[0] * shape[1]
    table = MatrixTable(
        torch.tensor(starts), torch.tensor(owners), torch.tensor([s[0] * s[1] for s, _ in mats]), tp, None
    )
    pieces, blocks = [], []
    for (shape, dim), start in zip(mats, starts, strict=True):
        index = torch.arange(start, start + shape[0] * shape[1]).view(shape).chunk(tp, dim)[rank].reshape(-1)
        pieces.append((index, torch.ones(len(index), dtype=torch.bool)))
        blocks.append(torch.randn(shape).chunk(tp, dim)[rank].contiguous())

    def transport(t, send, recv):
        return collectives.all_to_all(t, send, recv, None)

    gather_route = route(table, rank, [s for s, _ in mats], pieces, transport)

    def gather() -> None:
        values = torch.cat([b.reshape(-1) for b in blocks])
        gather_route.pieces(gather_route.exchange(values, lambda m, _: newton_schulz(m[0], settings), transport))

    def distributed() -> None:
        for block, (shape, dim) in zip(blocks, mats, strict=True):
            newton_schulz_sharded(block, shape, dim, settings, lambda t: collectives.all_reduce(t, None))

    out = {}
    for name, fn in (("gather", gather), ("distributed", distributed)):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = times
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from modelpar.testing import run_on_ranks

    rows = ["| model | NS dtype | gather s | distributed s | distributed / gather |"]
    rows.append("| --- | --- | ---: | ---: | ---: |")
    summary = {}
    for model, (hidden, ffn, layers) in MODELS.items():
        for ns_dtype in ("bf16", "fp32"):
            ranks = run_on_ranks(2, timed_rank, hidden, ffn, layers, ns_dtype, args.repeats, timeout_s=1800)
            med = {k: statistics.median(max(r[k][i] for r in ranks) for i in range(args.repeats)) for k in ranks[0]}
            rows.append(
                f"| {model}, {layers} layers | {ns_dtype} | {med['gather']:.3f} | {med['distributed']:.3f} | "
                f"{med['distributed'] / med['gather']:.2f} |"
            )
            summary[f"{model}/{ns_dtype}"] = med
            print(rows[-1], flush=True)
    md = "\n".join(rows) + "\n"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "muon_tp.md").write_text(md)
    payload = {"summary": summary, "repeats": args.repeats, "machine": platform.machine()}
    (args.results_dir / "muon_tp.json").write_text(json.dumps(payload, indent=1))
    print(md)


if __name__ == "__main__":
    main()
