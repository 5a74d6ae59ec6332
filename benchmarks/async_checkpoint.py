"""The training step's stall at a save step: asynchronous (``trainer.ckpt_async=true``) against synchronous saves.

    python benchmarks/async_checkpoint.py                # bench-tiny and a 1B-shaped model, a few minutes
    python benchmarks/async_checkpoint.py --models tiny  # bench-tiny only

For each model, one rank trains with a save every other step, once with synchronous saves and once with
asynchronous ones, alternating the two runs ``--rounds`` times in one process. Per save step:

- blocking: how long the save call held the training loop (sync: the whole write, hashed and signed;
  async: finishing the previous writer, if any, plus the snapshot to host memory);
- stall: the save call plus the two steps after it, minus two quiet steps (none with a save in flight), so
  the background writer's competition for the cores (2 here) counts against the async save.

The 1B-shaped model has llama-1b's widths (hidden 2048, 32 heads, 8 kv heads, ffn 8192) with 2 layers and a
32k vocabulary (265M parameters: 3.2 GB of weights and Adam moments written per save) so that it fits this
machine. Writes ``benchmarks/results/async_checkpoint.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from modelpar.testing import run_on_ranks
from modelpar.training.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, TrainerConfig

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {
    "tiny": ModelConfig(name="bench-tiny", vocab_size=256, hidden=256, layers=4, heads=8, kv_heads=4, ffn_hidden=688),
    "1b-shaped": ModelConfig(
        name="1b-shaped", vocab_size=32000, hidden=2048, layers=2, heads=32, kv_heads=8, ffn_hidden=8192
    ),
}
STEPS = 10  # saves after steps 3 and 6; steps 2, 9 and 10 are the quiet reference (step 1 warms up)
SAVE_AFTER = (3, 6)


def _config(model: ModelConfig, out: str, async_save: bool) -> TrainConfig:
    return TrainConfig(
        model=replace(model, max_seq_len=128),
        parallel=ParallelConfig(microbatches=1),
        optim=OptimConfig(warmup_steps=1),
        data=DataConfig(seq_len=128, global_batch=2),
        trainer=TrainerConfig(
            steps=STEPS, out_dir=out, progress=False, ckpt_every=0, ckpt_async=async_save, keep_last=1, timeout_s=600
        ),
    )


def _run(cfg: TrainConfig, data_path: str) -> dict:
    """One rank: train, saving after the steps of ``SAVE_AFTER``; time each step and each save call."""
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    steps, saves = [], {}
    while trainer.step < cfg.trainer.steps:
        began = time.perf_counter()
        trainer.train_step()
        steps.append(time.perf_counter() - began)
        if trainer.step in SAVE_AFTER:
            began = time.perf_counter()
            trainer.save_or_report()
            saves[trainer.step] = time.perf_counter() - began
    began = time.perf_counter()
    trainer.save_or_report(finish=True)  # the last writer, outside the timed steps
    return {"steps": steps, "saves": saves, "final_wait_s": time.perf_counter() - began}


def _stall(run: dict) -> tuple[float, float]:
    """(median blocking time of the save calls, median stall over save steps, quiet step), seconds. The stall
    of a save after step k: the save call plus what steps k+1 and k+2 took beyond a quiet step."""
    steps, saves = run["steps"], {int(k): v for k, v in run["saves"].items()}
    quiet = statistics.median([steps[1], steps[-2], steps[-1]])  # steps 2, 9 and 10: no save in flight
    stalls = [saves[k] + steps[k] + steps[k + 1] - 2 * quiet for k in saves]  # steps[k] is step k+1
    return statistics.median(saves.values()), statistics.median(stalls), quiet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,1b-shaped", help="comma-separated: tiny, 1b-shaped")
    parser.add_argument("--rounds", type=int, default=2, help="sync/async pairs per model (default 2)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="modelpar-async-bench-") as tmp:
        for name in args.models.split(","):
            model = MODELS[name]
            data = Path(tmp) / f"{name}.npy"
            np.save(data, np.random.default_rng(0).integers(0, model.vocab_size, 20_000, dtype=np.uint16))
            got: dict[str, list] = {"sync": [], "async": []}
            for r in range(args.rounds):
                for mode in ("sync", "async"):
                    out = str(Path(tmp) / f"{name}-{mode}-{r}")
                    (result,) = run_on_ranks(1, _run, _config(model, out, mode == "async"), str(data), timeout_s=3600)
                    got[mode].append(result)
            row = {"model": name}
            for mode in ("sync", "async"):
                blocking, stall, quiet = zip(*(_stall(run) for run in got[mode]), strict=True)
                row[mode] = {
                    "blocking_s": statistics.median(blocking),
                    "stall_s": statistics.median(stall),
                    "quiet_step_s": statistics.median(quiet),
                    "runs": got[mode],
                }
            row["stall_ratio"] = (
                row["async"]["stall_s"] / row["sync"]["stall_s"] if row["sync"]["stall_s"] > 0 else None
            )
            rows.append(row)
            print(
                f"{name}: sync blocking {row['sync']['blocking_s']:.3f} s, stall {row['sync']['stall_s']:.3f} s | "
                f"async blocking {row['async']['blocking_s']:.3f} s, stall {row['async']['stall_s']:.3f} s",
                flush=True,
            )
    lines = [
        "Stall of the training loop at a save step, one rank on this machine (2 cores), median over saves and runs",
        "",
        "| model | quiet step | sync: blocking | sync: stall | async: blocking | async: stall | async / sync stall |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s, a = row["sync"], row["async"]
        ratio = f"{row['stall_ratio']:.2f}" if row["stall_ratio"] is not None else "-"
        lines.append(
            f"| {row['model']} | {s['quiet_step_s']:.3f} s | {s['blocking_s']:.3f} s | {s['stall_s']:.3f} s | "
            f"{a['blocking_s']:.3f} s | {a['stall_s']:.3f} s | {ratio} |"
        )
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "async_checkpoint.md").write_text(text + "\n")
    (RESULTS / "async_checkpoint.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
