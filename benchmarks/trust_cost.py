"""What the trust checks cost: the dp-replica outlier check, checkpoint signing, and the silent-corruption
rerun, each raced against the same job without it, step by step in one run.

    python benchmarks/trust_cost.py                 # bench-tiny, 4 ranks, seq 128, global batch 16, m=8
    python benchmarks/trust_cost.py --rounds 12

Each pair of trainers (the same model, data and seed; one with the check, one without) lives on the same
emulated ranks and takes turns: one step of each per round, timed between barriers (the slowest rank's
time counts), medians over rounds, so load from other jobs hits both alike.

- outlier check (``trainer.grad_outlier_action=warn``): dp4, where it runs (it needs dp >= 3; at tp2 x pp2
  there is no replica to compare and it is off);
- signing (``trainer.signing_key``): tp2 x pp2, one checkpoint save with a key against one without (the HMAC
  covers ``index.json`` only; the files' SHA-256 is computed either way), reported per save and as a share
  of a step at ``trainer.ckpt_every=50``;
- silent-corruption check (``trainer.sdc_check_every=1``): tp2 x pp2, a checked step against a plain one;
  the extra time is the rerun of one micro-batch, paid every N steps.

Writes ``benchmarks/results/trust_cost.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from modelpar.model.config import ModelConfig
from modelpar.testing import run_on_ranks
from modelpar.training.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, TrainerConfig, validate

RESULTS = Path(__file__).resolve().parent / "results"
BENCH_TINY = ModelConfig(
    name="bench-tiny", vocab_size=4096, hidden=256, layers=8, heads=8, kv_heads=8, ffn_hidden=688, max_seq_len=128
)


def config(out: str, **parallel) -> TrainConfig:
    return TrainConfig(
        model=BENCH_TINY,
        parallel=ParallelConfig(**{"microbatches": 8, **parallel}),
        optim=OptimConfig(warmup_steps=0),
        data=DataConfig(seq_len=128, global_batch=16, seed=3),
        trainer=TrainerConfig(steps=1000, out_dir=out, progress=False, ckpt_every=0, check_every=0),
    )


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def race(base: TrainConfig, checked: TrainConfig, data: str, rounds: int, save: bool) -> dict:
    """On every rank: a trainer without and one with the check, alternating; per-round times of each."""
    from modelpar.training.trainer import Trainer

    plain, other = Trainer(base, data, None), Trainer(checked, data, None)
    plain.train_step(), other.train_step()  # warm-up
    times: dict[str, list[float]] = {"plain": [], "checked": []}
    for _ in range(rounds):
        for name, trainer in (("plain", plain), ("checked", other)):
            times[name].append(_timed(trainer.save if save else trainer.train_step))
            if save:
                trainer.step += 1  # the next save is a new step directory
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--results", default=str(RESULTS / "trust_cost"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="modelpar-trust-"))
    data = work / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, BENCH_TINY.vocab_size, size=400_000, dtype=np.uint16))
    key = work / "key"
    key.write_bytes(os.urandom(32).hex().encode())
    key.chmod(0o600)

    def pair(name: str, layout: dict, **trainer) -> tuple[TrainConfig, TrainConfig]:
        a = config(str(work / name / "plain"), **layout)
        b = config(str(work / name / "checked"), **layout)
        return a, replace(b, trainer=replace(b.trainer, **trainer))

    rows = []
    for label, layout, trainer, save in (
        ("outlier check (dp4, m=4)", {"dp": 4, "microbatches": 4}, {"grad_outlier_action": "warn"}, False),
        ("signing, per save (tp2 x pp2)", {"tp": 2, "pp": 2}, {"signing_key": str(key)}, True),
        ("sdc check step (tp2 x pp2)", {"tp": 2, "pp": 2}, {"sdc_check_every": 1}, False),
    ):
        a, b = pair(label.split()[0], layout, **trainer)
        if "outlier" in label:
            a = replace(a, trainer=replace(a.trainer, grad_outlier_action="off"))
        validate(a), validate(b)
        times = run_on_ranks(4, race, a, b, str(data), args.rounds, save, timeout_s=1800)[0]
        plain, checked = statistics.median(times["plain"]), statistics.median(times["checked"])
        rows.append({
            "check": label, "plain_ms": round(plain * 1e3, 2), "checked_ms": round(checked * 1e3, 2),
            "extra": round(checked / plain - 1, 4), "rounds": args.rounds,
            "plain_all_ms": [round(t * 1e3, 2) for t in times["plain"]],
            "checked_all_ms": [round(t * 1e3, 2) for t in times["checked"]],
        })  # fmt: skip
    step_ms = rows[2]["plain_ms"]  # a plain tp2 x pp2 step
    sign_extra_ms = rows[1]["checked_ms"] - rows[1]["plain_ms"]
    lines = [
        "# Cost of the trust checks (bench-tiny, seq 128, global batch 16, m=8, 4 ranks on this machine)",
        "",
        "| check | without (ms) | with (ms) | extra |",
        "|---|---|---|---|",
        *(f"| {r['check']} | {r['plain_ms']} | {r['checked_ms']} | {r['extra']:+.1%} |" for r in rows),
        "",
        f"Signing adds {sign_extra_ms:+.1f} ms per save: {sign_extra_ms / (50 * step_ms):+.2%} of the steps between "
        f"saves at trainer.ckpt_every=50 ({step_ms} ms a step). The silent-corruption check's extra is paid every "
        f"trainer.sdc_check_every steps: {rows[2]['extra'] / 100:+.2%} a step on average at N=100.",
    ]
    result = {"rows": rows, "machine": f"{os.cpu_count()} cores", "torch": torch.__version__}
    result["signing_share_at_ckpt_every_50"] = round(sign_extra_ms / (50 * step_ms), 5)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.results + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
