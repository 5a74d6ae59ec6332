"""ZB-V and DualPipeV against PyTorch's own: simulated bubble and peak activations, one cost model for both.

    python benchmarks/v_schedules.py                 # pp in {2, 4, 8}, m in {pp, 2pp, 4pp}; a few seconds
    python benchmarks/v_schedules.py --latency 0.1   # with a p2p latency of 0.1 forward-times

For each (pp, m), modelpar's zbv and dualpipev (``modelpar.pipeline.build_schedule``) and the compute orders
torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` generate for the same (pp, m) are simulated by
``modelpar.pipeline.simulate`` with the same costs (F = B = W = 1, B being the input-gradient half): torch's
orders are read from the classes' own per-rank generator, translated action by action (stage -> local chunk
of the V placement; DualPipeV's overlapped F+B pairs as the F then the B they contain; its full backward as B
then W), given the same sends and receives, and must pass the same deadlock check. 1F1B, ZB-H1 and interleaved
1F1B (vpp=2) are listed for reference. Peak activations: the most (micro-batch, chunk) pairs a rank holds
between a forward and its last backward action, over ranks, in units of one chunk's activations (1F1B's
chunk is the whole stage: 2 V chunks). Writes ``benchmarks/results/v_schedules.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from modelpar.bench.torch_schedules import torch_order
from modelpar.pipeline import build_schedule, simulate
from modelpar.pipeline.p2p_order import add_communication
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.simulate import Costs

RESULTS = Path(__file__).resolve().parent / "results"


def measure(schedule, costs: Costs) -> dict:
    sim = simulate(schedule, costs)
    return {"bubble": round(sim.bubble_fraction, 4), "peak_chunks": max(sim.peak_in_flight)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.0, help="p2p latency in forward-times (default 0)")
    args = parser.parse_args()
    costs = Costs(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0, latency=args.latency)
    rows = []
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp, 4 * pp):
            row = {"pp": pp, "m": m}
            for name, vpp in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2)):
                try:
                    row[name] = measure(build_schedule(name, pp, m, vpp), costs)
                except ValueError as exc:  # e.g. interleaved needs m divisible by pp
                    row[name] = {"error": str(exc)}
            for name in ("zbv", "dualpipev"):
                try:
                    compute = torch_order(name, pp, m)
                    row[f"torch-{name}"] = measure(add_communication(compute, pp, 2, Placement.V), costs)
                except Exception as exc:  # noqa: BLE001 - a torch order our runtime cannot run is a finding
                    row[f"torch-{name}"] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
            rows.append(row)
    names = ["1f1b", "zb-h1", "interleaved", "zbv", "torch-zbv", "dualpipev", "torch-dualpipev"]

    def cell(d: dict) -> str:
        return "error" if "error" in d else f"{100 * d['bubble']:.1f}% / {d['peak_chunks']}"

    lines = [
        f"Simulated bubble / peak activations (chunks) per schedule, F = B = W = 1, latency {args.latency:g}",
        "",
        "| pp | m | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    lines += [f"| {r['pp']} | {r['m']} | " + " | ".join(cell(r[n]) for n in names) + " |" for r in rows]
    errors = sorted({f"{n}: {r[n]['error']}" for r in rows for n in names if "error" in r[n]})
    if errors:
        lines += ["", "Not simulated:", *[f"- {e}" for e in errors]]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "v_schedules.md").write_text(text + "\n")
    (RESULTS / "v_schedules.json").write_text(json.dumps({"latency": args.latency, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
