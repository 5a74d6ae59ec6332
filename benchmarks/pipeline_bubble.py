"""Pipeline bubble on emulated CPU ranks: measured against the simulator's prediction, for every schedule.

    python benchmarks/pipeline_bubble.py              # pp=2 and pp=4, m=8, about a minute on 2 cores
    python benchmarks/pipeline_bubble.py --steps 5 --m 16

For each (pp, schedule) the ranks run a toy model sized so compute dominates p2p (hidden 256, MLP blocks)
for a warm-up step and ``--steps`` timed steps. From the runtime's action records it reports

- measured bubble: idle time between the first and last action, over ranks x span (median over steps);
- simulated bubble: ``simulate`` with the measured mean F, B (and W) durations and zero latency, and again
  with the p2p latency measured by a ping-pong of one activation between ranks 0 and 1;
- replayed bubble: ``simulate`` with every action's own measured duration and the measured latency (median
  over steps), so the gap to the measured bubble is runtime overhead and noise, not uneven stages or p2p;
- the unit-cost bubble (F=1, B=2 or B=W=1) for reference.

Results: a table on stdout, ``benchmarks/results/pipeline_bubble.json`` and the measured and simulated text
Gantt charts of the last configuration in ``pipeline_bubble_gantt.txt``. Emulated ranks share the machine's
cores: with more ranks than cores, ranks slow each other down and the measured bubble drifts from the
prediction; the JSON records the core count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from modelpar import ParallelLayout
from modelpar.cli.args import positive_int
from modelpar.pipeline import Costs, PipelineRuntime, Timeline, build_schedule, partition_uniform, simulate
from modelpar.pipeline.gantt import render_text
from modelpar.testing import current_groups, run_on_ranks

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class BenchConfig:
    vocab: int = 512
    hidden: int = 256
    layers: int = 8
    batch: int = 4  # per micro-batch
    seq: int = 64
    seed: int = 0


class MLPBlock(nn.Module):
    """``x + W2 tanh(W1 x)`` with a 4x wide middle; x: [b, s, h]."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def local_chunks(cfg: BenchConfig, pp: int, vpp: int, rank: int) -> list[nn.Sequential]:
    """This rank's chunks of embedding -> blocks -> head, cut by ``partition_uniform``."""
    torch.manual_seed(cfg.seed)
    layers = OrderedDict(embed=nn.Embedding(cfg.vocab, cfg.hidden))
    layers.update((f"block{i}", MLPBlock(cfg.hidden)) for i in range(cfg.layers))
    layers["head"] = nn.Linear(cfg.hidden, cfg.vocab)
    part = partition_uniform(cfg.layers, pp, vpp)
    chunks = []
    for c in part.chunks_of(rank):
        names = ["embed"] * part.has_embedding(c) + [f"block{i}" for i in part.layers(c)]
        names += ["head"] * part.has_head(c)
        chunks.append(nn.Sequential(OrderedDict((n, layers[n]) for n in names)))
    return chunks


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bench_rank(cfg: BenchConfig, name: str, m: int, steps: int) -> tuple[list, float]:
    """On one rank: the p2p latency, a warm-up step, then ``steps`` timed steps; the records of each timed step."""
    groups = current_groups()
    pp = groups.layout.pp
    vpp = 2 if name == "interleaved" else 1
    chunks = local_chunks(cfg, pp, vpp, groups.pp_rank)
    runtime = PipelineRuntime(
        chunks,
        groups,
        build_schedule(name, pp, m, vpp),
        activation_shape=(cfg.batch, cfg.seq, cfg.hidden),
        loss_fn=loss_fn,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, cfg.vocab, (m, cfg.batch, cfg.seq + 1), generator=gen)
    records = []
    latency = p2p_latency(cfg)
    for step in range(steps + 1):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        result = runtime.step(tokens[..., :-1], tokens[..., 1:])
        if step > 0:
            records.append(result.records)
    return records, latency


def p2p_latency(cfg: BenchConfig, rounds: int = 50) -> float:
    """Median one-way time (s) of one activation between pipeline ranks 0 and 1: half a ping-pong."""
    groups = current_groups()
    buf = torch.zeros(cfg.batch, cfg.seq, cfg.hidden)
    peer = groups.pp_ranks[1 - groups.pp_rank] if groups.pp_rank < 2 else None
    times = []
    for _ in range(rounds):
        dist.barrier(group=groups.pp_group)
        start = time.perf_counter()
        if groups.pp_rank == 0:
            dist.send(buf, peer, group=groups.pp_group)
            dist.recv(buf, peer, group=groups.pp_group)
        elif groups.pp_rank == 1:
            dist.recv(buf, peer, group=groups.pp_group)
            dist.send(buf, peer, group=groups.pp_group)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def measured_durations(timeline: Timeline) -> dict:
    """Each compute action's own measured duration."""
    return {t.action: t.duration for row in timeline.rows for t in row if t.action.kind.is_compute}


def mean_durations(timelines: list[Timeline]) -> dict[str, float]:
    """Mean duration of F, B and W over every rank and step (seconds)."""
    by_kind: dict[str, list[float]] = {}
    for timeline in timelines:
        for row in timeline.rows:
            for timed in row:
                if timed.action.kind.is_compute:
                    by_kind.setdefault(timed.action.kind.value, []).append(timed.duration)
    return {kind: statistics.fmean(values) for kind, values in sorted(by_kind.items())}


def run(cfg: BenchConfig, pps: list[int], m: int, steps: int) -> tuple[list[dict], str]:
    rows, gantt = [], ""
    for pp in pps:
        for name in ("gpipe", "1f1b", "interleaved", "zb-h1"):
            vpp = 2 if name == "interleaved" else 1
            per_rank = run_on_ranks(pp, bench_rank, cfg, name, m, steps, layout=ParallelLayout(pp=pp), timeout_s=600)
            timelines = [Timeline(tuple(per_rank[r][0][s] for r in range(pp))) for s in range(steps)]
            latency = per_rank[0][1]
            durations = mean_durations(timelines)
            schedule = build_schedule(name, pp, m, vpp)
            predicted = simulate(schedule, Costs.from_mapping(durations))
            with_latency = simulate(schedule, Costs.from_mapping(durations | {"latency": latency}))
            measured = statistics.median(t.bubble_fraction for t in timelines)
            replayed = statistics.median(
                simulate(schedule, Costs(latency=latency, per_action=measured_durations(tl))).bubble_fraction
                for tl in timelines
            )
            rows.append(
                {
                    "pp": pp,
                    "schedule": name,
                    "vpp": vpp,
                    "m": m,
                    "mean_ms": {k: round(v * 1e3, 3) for k, v in durations.items()},
                    "step_ms": round(statistics.median(t.span for t in timelines) * 1e3, 2),
                    "simulated_step_ms": round(predicted.makespan * 1e3, 2),
                    "measured_bubble": round(measured, 4),
                    "p2p_latency_ms": round(latency * 1e3, 3),
                    "simulated_bubble": round(predicted.bubble_fraction, 4),
                    "simulated_bubble_with_latency": round(with_latency.bubble_fraction, 4),
                    "replayed_bubble": round(replayed, 4),
                    "unit_cost_bubble": round(simulate(schedule).bubble_fraction, 4),
                }
            )
            print(format_row(rows[-1]), flush=True)
            title = f"pp={pp} {name} m={m}"
            gantt = "\n\n".join(
                [
                    render_text(timelines[-1], title=f"measured, {title}"),
                    render_text(predicted.timeline, title=f"simulated with measured mean durations, {title}"),
                ]
            )
    return rows, gantt


HEADER = f"{'pp':>3} {'schedule':<12} {'m':>3} {'F/B/W ms':>20} {'step ms':>9} {'sim ms':>9} " + (
    f"{'measured':>9} {'simulated':>9} {'+latency':>9} {'replayed':>9} {'unit-cost':>9}"
)


def format_row(row: dict) -> str:
    fbw = "/".join(f"{row['mean_ms'][k]:.2f}" for k in ("F", "B", "W") if k in row["mean_ms"])
    return (
        f"{row['pp']:>3} {row['schedule']:<12} {row['m']:>3} {fbw:>20} {row['step_ms']:>9.1f} "
        f"{row['simulated_step_ms']:>9.1f} {row['measured_bubble']:>9.1%} {row['simulated_bubble']:>9.1%} "
        f"{row['simulated_bubble_with_latency']:>9.1%} {row['replayed_bubble']:>9.1%} {row['unit_cost_bubble']:>9.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=positive_int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=positive_int, default=8, help="micro-batches per step (a multiple of every pp)")
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "pipeline_bubble.json")
    args = parser.parse_args()
    if any(args.m % pp for pp in args.pp):
        pps = " ".join(map(str, args.pp))
        parser.error(f"--m {args.m} is not a multiple of every --pp {pps}; e.g. --m {math.lcm(*args.pp) * 2}")
    cfg = BenchConfig()
    load_before = os.getloadavg()[0]
    print("bubble fraction: measured from the runtime's records vs simulated from measured mean durations")
    print(HEADER)
    rows, gantt = run(cfg, args.pp, args.m, args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": asdict(cfg),
        "steps": args.steps,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "note": "emulated ranks (gloo, 1 thread each) share the cores with whatever else runs (see load average)",
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_name("pipeline_bubble_gantt.txt").write_text(gantt + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    # Run as a script, this file is __main__, which forkserver workers cannot import: re-import it by name so
    # that run_on_ranks can pickle bench_rank.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import pipeline_bubble

    pipeline_bubble.main()
