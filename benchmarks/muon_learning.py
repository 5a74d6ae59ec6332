"""Does Muon learn? Muon beside a tuned AdamW on the default corpus: held-out loss curves, steps to AdamW's loss.

    python benchmarks/muon_learning.py --steps 150       # lr 3e-3 and 1e-2 x 3 seeds per optimizer, one CPU rank
    python benchmarks/muon_learning.py --steps 150 --adamw-lrs 1e-3 --muon-lrs 3e-2 --name muon_learning_edges

Each run trains the `single` recipe (the default corpus, Python's standard-library source, byte-level; its
sequence length and batch) on one rank in fp32, with the model shrunk to fit a 2-core machine (hidden 64, 2
layers; ``--set`` changes it), with ``optim.name=adamw`` or ``optim.name=muon`` (Muon for the hidden matrices
with ``match_rms_adamw``, so both share one learning rate and weight decay; AdamW for embeddings and norms).
Every optimizer runs every ``--lrs`` learning rate with ``--seeds`` seeds (seed i: ``trainer.seed=i``,
``data.seed=1234+i``, the same for both). The held-out loss (the first ``--windows`` windows of the held-out
split) is measured at step 0 and every ``--every`` steps and averaged over the seeds; each optimizer's best
learning rate is the one with the lowest final mean. Reported: the curves of the two tuned runs, and the first
measured step at which each reaches the tuned AdamW's final held-out loss. Results:
``benchmarks/results/muon_learning.json``, ``muon_learning.md`` and, when matplotlib is installed, ``.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_curve import held_out_loss

RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SMALL = ["model.hidden=64", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=176"]
OPTIMIZERS = ("adamw", "muon")


def train_curve(cfg, data_path: str, val_path: str, windows: int, every: int) -> tuple[dict[int, float], float]:
    """On one rank: the held-out loss at step 0 and every ``every``-th step, and the training seconds."""
    from modelpar.data import open_dataset
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    inputs, targets = open_dataset(val_path, cfg.model.vocab_size, cfg.data.seq_len).batch(range(windows))
    held, took = {0: held_out_loss(trainer, inputs, targets)}, 0.0
    while trainer.step < cfg.trainer.steps:
        start = time.perf_counter()
        trainer.train_step()
        took += time.perf_counter() - start
        if trainer.step % every == 0 or trainer.step == cfg.trainer.steps:
            held[trainer.step] = held_out_loss(trainer, inputs, targets)
    return held, took


def mean_curve(runs: list[dict[int, float]]) -> dict[int, float]:
    return {step: sum(run[step] for run in runs) / len(runs) for step in runs[0]}


def steps_to(curve: dict[int, float], target: float) -> int | None:
    """The first measured step at which ``curve`` is at or below ``target`` (None: never)."""
    return next((step for step in sorted(curve) if curve[step] <= target), None)


def plot(curves: dict[str, dict[int, float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, curve in curves.items():
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], marker=".", label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (mean over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2], help="every optimizer's learning rates")
    ap.add_argument("--adamw-lrs", type=float, nargs="+", help="AdamW's own (instead of --lrs)")
    ap.add_argument("--muon-lrs", type=float, nargs="+", help="Muon's own (instead of --lrs)")
    ap.add_argument("--name", default="muon_learning", help="results file name (without extension)")
    ap.add_argument("--merge", type=Path, nargs="*", default=[], help="earlier JSON results whose runs join these")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides (model.hidden=64 ...)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
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
        "trainer.out_dir=runs/muon-learning",
        "trainer.ckpt_every=0",
        "trainer.progress=false",
        "trainer.sample_tokens=0",
        "trainer.check_every=0",
        "trainer.dtype=fp32",
        *args.set,
    ]
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        base = OmegaConf.to_object(compose(config_name="single", overrides=overrides))
    data_path, val_path = resolve_data(base)
    held: dict[str, list[dict[int, float]]] = {}
    seconds: dict[str, list[float]] = {}
    lrs = {"adamw": args.adamw_lrs or args.lrs, "muon": args.muon_lrs or args.lrs}
    for name in OPTIMIZERS:
        for lr in lrs[name]:
            label = f"{name} lr={lr:g}"
            held[label], seconds[label] = [], []
            for seed in range(args.seeds):
                cfg = replace(
                    base,
                    optim=replace(base.optim, name=name, lr=lr, min_lr=lr / 10),
                    trainer=replace(base.trainer, seed=seed),
                    data=replace(base.data, seed=base.data.seed + seed),
                )
                validate(cfg)
                ((curve, took),) = run_on_ranks(
                    1, train_curve, cfg, str(data_path), str(val_path), args.windows, args.every, timeout_s=3600
                )
                held[label].append(curve)
                seconds[label].append(took)
                print(f"{label} seed {seed}: held-out {curve[0]:.4f} -> {curve[args.steps]:.4f} in {took:.1f} s")
    for earlier in args.merge:  # the same protocol's runs at other learning rates
        saved = json.loads(earlier.read_text())
        for label, runs in saved["held_out"].items():
            if label not in held:
                held[label] = [{int(k): v for k, v in run.items()} for run in runs]
                seconds[label] = saved["seconds"][label]
                name = label.split()[0]
                theirs = saved["lrs"][name] if isinstance(saved["lrs"], dict) else saved["lrs"]
                lrs[name] = sorted({*lrs[name], *theirs})
    means = {label: mean_curve(runs) for label, runs in held.items()}
    best = {
        name: min((label for label in means if label.startswith(name + " ")), key=lambda lab: means[lab][args.steps])
        for name in OPTIMIZERS
    }
    target = means[best["adamw"]][args.steps]
    reach = {name: steps_to(means[best[name]], target) for name in OPTIMIZERS}
    rows = [
        "| run | " + " | ".join(f"step {s}" for s in sorted(means[best["adamw"]])) + " | s/step |",
        "| --- | " + " | ".join("---:" for _ in means[best["adamw"]]) + " | ---: |",
    ]
    for label, curve in means.items():
        mark = " (tuned)" if label in best.values() else ""
        per_step = sum(seconds[label]) / len(seconds[label]) / args.steps
        rows.append(
            f"| {label}{mark} | " + " | ".join(f"{curve[s]:.4f}" for s in sorted(curve)) + f" | {per_step:.3f} |"
        )
    summary = (
        f"Tuned AdamW ({best['adamw']}) ends at held-out {target:.4f} (mean of {args.seeds} seeds, step "
        f"{args.steps}). Steps to reach it: AdamW {reach['adamw']}, Muon ({best['muon']}) {reach['muon']} "
        f"(measured every {args.every} steps; None: not reached).\n"
    )
    md = "\n".join(rows) + "\n\n" + summary
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.name}.md").write_text(md)
    (args.results_dir / f"{args.name}.json").write_text(
        json.dumps(
            {
                "steps": args.steps,
                "seeds": args.seeds,
                "lrs": lrs,
                "model": overrides[: len(SMALL)] + args.set,
                "held_out": {lab: [{str(k): v for k, v in run.items()} for run in runs] for lab, runs in held.items()},
                "seconds": seconds,
                "tuned": best,
                "adamw_final": target,
                "steps_to_adamw_final": reach,
                "machine": platform.machine(),
                "torch_threads": 1,
            },
            indent=1,
        )
    )
    plot(means, args.results_dir / f"{args.name}.png")
    print(md)


if __name__ == "__main__":
    main()
