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

from modelpar.pipeline import build_schedule, simulate
from modelpar.pipeline.actions import Action, ActionKind, Schedule
from modelpar.pipeline.p2p_order import add_communication
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.simulate import Costs

RESULTS = Path(__file__).resolve().parent / "results"


def torch_order(name: str, pp: int, m: int) -> Schedule:
    """The compute order torch's schedule class ``name`` generates (no process group needed to ask for it)."""
    from torch.distributed.pipelining import schedules as ts

    cls = {"zbv": ts.ScheduleZBVZeroBubble, "dualpipev": ts.ScheduleDualPipeV}[name]
    sched = object.__new__(cls)  # the generator reads only these three fields
    sched.pp_group_size, sched._n_microbatches, sched.num_stages = pp, m, 2 * pp
    rows = []
    for rank in range(pp):
        row = []
        for act in sched._calculate_single_rank_operations(rank):
            if act is not None:
                row.extend(_translate(act, rank, pp, ts))
        rows.append(row)
    return Schedule(rows, Placement.V)


def _translate(act, rank: int, pp: int, ts) -> list[Action]:
    kind = act.computation_type
    if kind == ts.OVERLAP_F_B:
        return [a for sub in act.sub_actions for a in _translate(sub, rank, pp, ts)]
    chunk = 0 if act.stage_index == rank else 1
    if chunk == 1 and act.stage_index != 2 * pp - 1 - rank:
        raise ValueError(f"stage {act.stage_index} is not on rank {rank} in a V of {pp} ranks")
    mb = act.microbatch_index
    if kind == ts.FORWARD:
        return [Action(rank, ActionKind.F, mb, chunk)]
    if kind == ts.BACKWARD_INPUT:
        return [Action(rank, ActionKind.B, mb, chunk)]
    if kind == ts.BACKWARD_WEIGHT:
        return [Action(rank, ActionKind.W, mb, chunk)]
    if kind == ts.FULL_BACKWARD:
        return [Action(rank, ActionKind.B, mb, chunk), Action(rank, ActionKind.W, mb, chunk)]
    raise ValueError(f"unexpected torch action {act}")


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
