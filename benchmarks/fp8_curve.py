"""FP8 still learns: the loss curve of model.fp8=off, rowwise and tensorwise over the same steps and data.

    python benchmarks/fp8_curve.py                    # 300 steps each, the default corpus, one CPU rank, bf16
    python benchmarks/fp8_curve.py --steps 100 --set model.hidden=64
    python benchmarks/fp8_curve.py --dtype fp32       # the off run (and the rest) without bf16 autocast

Each mode trains the `single` recipe (the default corpus, Python's standard-library source, byte-level; its
sequence length and batch) from the same seed on one rank, with the model shrunk to fit a 2-core machine in a few
minutes (hidden 32, 2 layers; ``--set`` changes it), under ``trainer.dtype=bf16`` (bf16 autocast over fp32
masters, as on a GPU: the off run is the bf16 curve the FP8 ones are held to; ``--dtype fp32`` drops autocast).
Every step's loss is recorded; the table lists every 25th step with each FP8 mode's relative difference from the
off run. Results: ``benchmarks/results/fp8_curve.json``, ``fp8_curve.md`` and, when matplotlib is installed,
``fp8_curve.png``.
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
SMALL = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=96"]
EVERY = 25


def train_losses(cfg, data_path: str) -> tuple[list[float], float]:
    """On one rank: every step's loss, and the seconds the steps took."""
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    start, losses = time.perf_counter(), []
    while trainer.step < cfg.trainer.steps:
        losses.append(float(trainer.train_step().loss))
    return losses, time.perf_counter() - start


def markdown(curves: dict[str, list[float]], steps: int) -> str:
    lines = [
        "| step | off | rowwise | rel. diff | tensorwise | rel. diff |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for step in [1, *range(EVERY, steps + 1, EVERY)]:
        off = curves["off"][step - 1]
        cells = [f"{step}", f"{off:.4f}"]
        for mode in MODES[1:]:
            loss = curves[mode][step - 1]
            cells += [f"{loss:.4f}", f"{(loss - off) / off:+.2%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def worst(curves: dict[str, list[float]], steps: int) -> dict[str, float]:
    """Each FP8 mode's largest |relative difference| from off over the table's steps."""
    marks = [1, *range(EVERY, steps + 1, EVERY)]
    return {
        mode: max(abs(curves[mode][s - 1] - curves["off"][s - 1]) / curves["off"][s - 1] for s in marks)
        for mode in MODES[1:]
    }


def plot(curves: dict[str, list[float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=f"fp8={mode}", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
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
    data_path, _ = resolve_data(base)
    curves, seconds = {}, {}
    for mode in MODES:
        cfg = replace(base, model=replace(base.model, fp8=mode))
        validate(cfg)
        ((losses, took),) = run_on_ranks(1, train_losses, cfg, str(data_path), timeout_s=3600)
        curves[mode], seconds[mode] = losses, took
        print(f"fp8={mode}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {took:.0f} s", flush=True)
    text = markdown(curves, args.steps)
    diffs = worst(curves, args.steps)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    png = plot(curves, args.results_dir / "fp8_curve.png")
    payload = {
        "steps": args.steps,
        "overrides": overrides,
        "model": {k: getattr(base.model, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden")},
        "data": {"seq_len": base.data.seq_len, "global_batch": base.data.global_batch},
        "max_rel_diff_every_25": diffs,
        "seconds": seconds,
        "losses": curves,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_1min": os.getloadavg()[0]},
        "png": png,
    }
    (args.results_dir / "fp8_curve.json").write_text(json.dumps(payload, indent=1) + "\n")
    summary = ", ".join(f"{m} {d:.2%}" for m, d in diffs.items())
    (args.results_dir / "fp8_curve.md").write_text(
        f"# FP8 loss curve ({args.steps} steps, `single` recipe, trainer.dtype={args.dtype}, {' '.join(SMALL)})\n\n"
        f"Largest relative difference from fp8=off at every {EVERY}th step: {summary}.\n\n" + text
    )
    print(text + f"max |rel. diff|: {summary}" + ("" if png else " (matplotlib not installed: no PNG)"))


if __name__ == "__main__":
    main()
