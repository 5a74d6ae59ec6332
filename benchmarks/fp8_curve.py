"""FP8 still learns: the loss curve of model.fp8=off, rowwise and tensorwise over the same steps and data.

    python benchmarks/fp8_curve.py                    # 300 steps each, the default corpus, one CPU rank, bf16
    python benchmarks/fp8_curve.py --steps 100 --set model.hidden=64
    python benchmarks/fp8_curve.py --dtype fp32       # the off run (and the rest) without bf16 autocast

Each mode trains the `single` recipe (the default corpus, Python's standard-library source, byte-level; its
sequence length and batch) on one rank, with the model shrunk to fit a 2-core machine in a few minutes (hidden
32, 2 layers; ``--set`` changes it), under ``trainer.dtype=bf16`` (bf16 autocast over fp32 masters, as on a GPU:
the off run is the bf16 curve the FP8 ones are held to; ``--dtype fp32`` drops autocast). ``--seeds`` runs of each
mode (seed i: ``trainer.seed=i``, ``data.seed=1234+i``, the same for every mode). The curve is the held-out loss
(the first ``--windows`` windows of the corpus's held-out split, forwards only under the training autocast) at
step 0 and every 25th step, averaged over the seeds; each FP8 mode's relative difference from off is taken there.
A single batch's training loss measures the batch as much as the model, so it is listed beside (seed 0) but not
held to the goal. Results: ``benchmarks/results/fp8_curve.json``, ``fp8_curve.md`` and, when matplotlib is
installed, ``fp8_curve.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
MODES = ("off", "rowwise", "tensorwise")
FLOOR = "off-fp32"  # fp8=off without autocast: how far bf16 itself is from fp32 by the same measure
SMALL = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=96"]
EVERY = 25


def held_out_loss(trainer, inputs, targets) -> float:
    """Mean next-token loss of the trainer's model on fixed held-out windows: forwards only, through the same
    pipeline runtime and under the same autocast as its training step."""
    import torch

    from modelpar.pipeline import PipelineRuntime, forward_only

    chunks = trainer.model.chunks
    runtime = PipelineRuntime(
        chunks,
        trainer.groups,
        forward_only(trainer.cfg.parallel.schedule, 1, 1),
        activation_shape=chunks[0].activation_shape(inputs.shape[0], inputs.shape[1]),
        loss_fn=chunks[-1].loss,
        device=trainer.device,
    )
    autocast = trainer.cfg.trainer.dtype == "bf16"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return float(runtime.step([inputs], [targets]).loss)


def train_losses(cfg, data_path: str, val_path: str, windows: int) -> tuple[list[float], dict[int, float], float]:
    """On one rank: every step's training loss, the held-out loss at step 0 and every ``EVERY``-th step, and the
    seconds the training steps took (the held-out forwards not counted)."""
    from modelpar.data import open_dataset
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    inputs, targets = open_dataset(val_path, cfg.model.vocab_size, cfg.data.seq_len).batch(range(windows))
    held, losses, took = {0: held_out_loss(trainer, inputs, targets)}, [], 0.0
    while trainer.step < cfg.trainer.steps:
        start = time.perf_counter()
        losses.append(float(trainer.train_step().loss))
        took += time.perf_counter() - start
        if trainer.step % EVERY == 0 or trainer.step == cfg.trainer.steps:
            held[trainer.step] = held_out_loss(trainer, inputs, targets)
    return losses, held, took


def marks(steps: int) -> list[int]:
    return [0, *range(EVERY, steps + 1, EVERY)]


def seed_mean(runs: list[dict[int, float]], step: int) -> float:
    return sum(run[step] for run in runs) / len(runs)


def rel(a: float, b: float) -> float:
    return (a - b) / b


def markdown(held: dict[str, list[dict[int, float]]], train: dict[str, list[list[float]]], steps: int) -> str:
    """The held-out curve (mean over seeds) at every mark, each FP8 mode's relative difference from off, and the
    seed-0 single-batch training loss beside it."""
    compared = [mode for mode in held if mode != "off"]
    lines = [
        "| step | off held-out | "
        + " | ".join(f"{mode} | rel. diff" for mode in compared)
        + " | seed-0 train loss off / rowwise / tensorwise |",
        "| ---: | ---: | " + " | ".join("---: | ---:" for _ in compared) + " | --- |",
    ]
    for step in marks(steps):
        off = seed_mean(held["off"], step)
        cells = [f"{step}", f"{off:.4f}"]
        for mode in compared:
            loss = seed_mean(held[mode], step)
            cells += [f"{loss:.4f}", f"{rel(loss, off):+.2%}"]
        cells.append(" / ".join(f"{train[m][0][step - 1]:.4f}" for m in MODES) if step else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def worst(held: dict[str, list[dict[int, float]]], train: dict[str, list[list[float]]], steps: int) -> dict:
    """Each FP8 mode's largest |relative difference| from off over the marks: of the seed-mean held-out curve
    (the goal's measure), of single seeds' held-out curves, and of seed 0's single-batch training loss."""
    out = {}
    for mode in [mode for mode in held if mode != "off"]:
        out[mode] = {
            "held_out_seed_mean": max(
                abs(rel(seed_mean(held[mode], s), seed_mean(held["off"], s))) for s in marks(steps)
            ),
            "held_out_any_seed": max(
                abs(rel(run[s], ref[s])) for run, ref in zip(held[mode], held["off"], strict=True) for s in marks(steps)
            ),
            "train_loss_seed0": max(abs(rel(train[mode][0][s - 1], train["off"][0][s - 1])) for s in marks(steps)[1:]),
        }
    return out


def plot(held: dict[str, list[dict[int, float]]], train: dict[str, list[list[float]]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in held:
        steps = sorted(held[mode][0])
        left.plot(steps, [seed_mean(held[mode], s) for s in steps], marker=".", label=mode, linewidth=1)
        right.plot(range(1, len(train[mode][0]) + 1), train[mode][0], label=mode, linewidth=0.8)
    left.set_title(f"held-out loss, mean of {len(held['off'])} seeds")
    right.set_title("training loss, seed 0")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3, help="runs per mode; seed i: trainer.seed=i, data.seed=1234+i")
    ap.add_argument("--windows", type=int, default=32, help="held-out windows scored at every mark")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides (model.hidden=64 ...)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="trainer.dtype of every run")
    args = ap.parse_args(argv)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.testing import run_on_ranks
    from modelpar.training.config import register_schema, validate
    from modelpar.training.preflight import resolve_data

    register_schema()
    overrides = [
        *SMALL,
        f"trainer.steps={args.steps}",
        "trainer.out_dir=runs/fp8-curve",
        "trainer.ckpt_every=0",
        "trainer.progress=false",
        "trainer.sample_tokens=0",
        "trainer.check_every=0",
        f"trainer.dtype={args.dtype}",
        *args.set,
    ]
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        base = OmegaConf.to_object(compose(config_name="single", overrides=overrides))
    data_path, val_path = resolve_data(base)
    runs = {mode: (mode, args.dtype) for mode in MODES}
    if args.dtype == "bf16":  # the floor: the same measure between bf16 and fp32 without FP8
        runs[FLOOR] = ("off", "fp32")
    train, held, seconds = ({label: [] for label in runs} for _ in range(3))
    for seed in range(args.seeds):
        for mode, (fp8, dtype) in runs.items():
            cfg = replace(
                base,
                model=replace(base.model, fp8=fp8),
                trainer=replace(base.trainer, seed=seed, dtype=dtype),
                data=replace(base.data, seed=base.data.seed + seed),
            )
            validate(cfg)
            ((losses, marks_held, took),) = run_on_ranks(
                1, train_losses, cfg, str(data_path), str(val_path), args.windows, timeout_s=3600
            )
            train[mode].append(losses)
            held[mode].append(marks_held)
            seconds[mode].append(took)
            print(
                f"seed {seed} {mode}: held-out {marks_held[0]:.4f} -> {marks_held[args.steps]:.4f}, "
                f"train {losses[0]:.4f} -> {losses[-1]:.4f} in {took:.0f} s",
                flush=True,
            )
    text = markdown(held, train, args.steps)
    diffs = worst(held, train, args.steps)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    png = plot(held, train, args.results_dir / "fp8_curve.png")
    payload = {
        "steps": args.steps,
        "seeds": args.seeds,
        "held_out_windows": args.windows,
        "overrides": overrides,
        "model": {k: getattr(base.model, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden")},
        "data": {"seq_len": base.data.seq_len, "global_batch": base.data.global_batch, "val_path": str(val_path)},
        "max_rel_diff": diffs,
        "seconds": seconds,
        "held_out": {mode: [{str(k): v for k, v in run.items()} for run in seeds] for mode, seeds in held.items()},
        "train_losses": train,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_1min": os.getloadavg()[0]},
        "png": png,
    }
    (args.results_dir / "fp8_curve.json").write_text(json.dumps(payload, indent=1) + "\n")
    summary = "; ".join(
        f"{m}: held-out (mean of {args.seeds} seeds) {d['held_out_seed_mean']:.2%}, any single seed's held-out "
        f"{d['held_out_any_seed']:.2%}, seed 0's single-batch training loss {d['train_loss_seed0']:.2%}"
        for m, d in diffs.items()
    )
    (args.results_dir / "fp8_curve.md").write_text(
        f"# FP8 loss curve ({args.steps} steps, `single` recipe, trainer.dtype={args.dtype}, "
        f"{' '.join(SMALL + args.set)})\n\n"
        f"Held-out loss on the first {args.windows} windows of the corpus's held-out split, at step 0 and every "
        f"{EVERY}th step, for {args.seeds} seeds per mode (seed i: trainer.seed=i, data.seed=1234+i). Largest "
        f"relative difference from fp8=off at those steps: {summary}. "
        + (
            f"`{FLOOR}` is fp8=off without autocast (fp32): bf16's own distance from fp32 by the same measure. "
            if FLOOR in runs
            else ""
        )
        + "\n\n"
        + text
    )
    print(text + summary + ("" if png else " (matplotlib not installed: no PNG)"))


if __name__ == "__main__":
    main()
