"""modelpar-train: pretrain with a Hydra recipe on any tp x pp x dp layout.

    modelpar-train                                   # recipes/train.yaml: tiny model, tp=2 x pp=2, 1F1B, 4 CPU ranks
    modelpar-train parallel=dp2-tp2-pp2 trainer.steps=50
    modelpar-train parallel.tp=2 parallel.pp=2 parallel.schedule=zb-h1 parallel.microbatches=8
    modelpar-train -m parallel=single,tp2,pp2        # a Hydra multirun sweep

Everything that can be checked is checked here, before any rank starts (one line per problem). Outside
torchrun/SLURM the ranks are spawned locally; under them, this process is one rank.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from modelpar.backends import rank_setup
from modelpar.checkpoint.store import CheckpointError, latest_checkpoint, read_index
from modelpar.data import DataError, TokenFile, default_corpus
from modelpar.parallel.launch import LaunchError, launch
from modelpar.parallel.layout import LayoutError
from modelpar.parallel.world import launch_env_from_environ
from modelpar.pipeline import PartitionError, ScheduleError, build_schedule
from modelpar.training.config import RECIPES, RecipeError, TrainConfig, register_schema, validate

USER_ERRORS = (RecipeError, LayoutError, DataError, ScheduleError, PartitionError, CheckpointError, ValueError)


def fail(message: str) -> None:
    print(f"modelpar-train: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def resolve_data(cfg: TrainConfig) -> tuple[str, str]:
    """Training and validation token files; the default corpus is built (once) when no path is given."""
    if cfg.data.path:
        return cfg.data.path, cfg.data.val_path or cfg.data.path
    info = default_corpus(cfg.data.cache_dir, max_bytes=cfg.data.corpus_max_bytes)
    return str(info.path), str(info.val_path)


def resolve_resume(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: ``auto`` takes the run directory's latest, if any."""
    mode = cfg.trainer.resume
    if mode == "never":
        root = Path(cfg.trainer.out_dir) / "checkpoints"
        if latest_checkpoint(root) is not None:
            raise RecipeError(
                f"{root} already holds checkpoints and trainer.resume=never; "
                "use a new trainer.out_dir (or hydra.run.dir), or trainer.resume=auto"
            )
        return None
    if mode == "auto":
        found = newest_good_checkpoint(Path(cfg.trainer.out_dir) / "checkpoints")
        return str(found) if found else None
    read_index(mode)  # verify before starting ranks
    return mode


def newest_good_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` that verifies; each one skipped is named with the reason."""
    if not root.is_dir():
        return None
    for debris in sorted(root.glob("step-*.tmp")):
        print(f"modelpar-train: ignoring {debris}: a save that did not complete", file=sys.stderr)
    for ckpt in sorted(root.glob("step-*[0-9]"), reverse=True):
        try:
            read_index(ckpt, verify=True)
        except CheckpointError as exc:
            aside = ckpt.with_name(ckpt.name + ".corrupt")
            with contextlib.suppress(OSError):  # under torchrun every rank checks; one of them moves it
                ckpt.rename(aside)  # kept for inspection; the run will write this step again
            print(f"modelpar-train: skipping {ckpt.name} (moved to {aside.name}): {exc}", file=sys.stderr)
            continue
        return ckpt
    return None


def runs_on_cpu(cfg: TrainConfig) -> bool:
    """Whether the ranks will compute on CPU cores (``trainer.device`` cpu, or auto without CUDA)."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def check_recipe(cfg: TrainConfig) -> None:
    """The recipe alone: fields, layout against the model, schedule against the micro-batches, partition."""
    from modelpar.training.build import build_partition

    validate(cfg)
    build_schedule(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.microbatches, cfg.parallel.vpp)
    build_partition(cfg)


def preflight(cfg: TrainConfig) -> tuple[str, str, str | None]:
    """Every check that needs no rank: recipe, layout, schedule, data, checkpoint."""
    check_recipe(cfg)
    train_path, val_path = resolve_data(cfg)
    tokens = TokenFile.open(train_path, cfg.model.vocab_size, cfg.data.seq_len)
    if tokens.num_windows < cfg.data.global_batch:
        raise DataError(
            f"{train_path} has {tokens.num_windows} windows of {cfg.data.seq_len + 1} tokens, fewer than "
            f"data.global_batch={cfg.data.global_batch}; use more data or a smaller batch"
        )
    return train_path, val_path, resolve_resume(cfg)


def run(cfg: TrainConfig) -> None:
    from modelpar.training.trainer import train_worker

    try:
        train_path, val_path, resume_from = preflight(cfg)
    except USER_ERRORS as exc:
        fail(str(exc))
    out_dir = Path(cfg.trainer.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = cfg.parallel.layout()
    print(
        f"modelpar-train: {cfg.model.name} on {layout} ({layout.world_size} ranks), schedule {cfg.parallel.schedule}, "
        f"{cfg.parallel.microbatches} micro-batches, {cfg.trainer.steps} steps -> {out_dir}"
        + (f", resuming from {resume_from}" if resume_from else ""),
        flush=True,
    )
    try:
        launch(
            layout.world_size,
            train_worker,
            cfg,
            train_path,
            resume_from,
            True,  # preflight verified the checkpoint: the ranks load it without hashing it again
            timeout_s=cfg.trainer.timeout_s,
            threads_per_rank=cfg.trainer.threads_per_rank,
            flight_dir=str(out_dir / "flight"),
            rank_setup=rank_setup(runs_on_cpu(cfg), cfg.trainer.threads_per_rank, cfg.trainer.cpu_affinity),
        )
    except LaunchError as exc:
        print(f"modelpar-train: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    env = launch_env_from_environ()
    if env is None or env.rank == 0:  # under torchrun/SLURM every rank ran this function
        summarize(cfg, val_path)


def summarize(cfg: TrainConfig, val_path: str) -> None:
    """Loss at the start and end of the run, the checkpoint, and a sample from the final weights."""
    from modelpar.cli.generate import sample_from_checkpoint

    out_dir = Path(cfg.trainer.out_dir)
    ckpt = latest_checkpoint(out_dir / "checkpoints")
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    if lines:
        import json

        first, last = json.loads(lines[0]), json.loads(lines[-1])
        start, end = f"{first['loss']:.4f} (step {first['step']})", f"{last['loss']:.4f} (step {last['step']})"
        print(f"modelpar-train: loss {start} -> {end}")
    if ckpt is None:
        return
    print(f"modelpar-train: checkpoint {ckpt}")
    if cfg.trainer.sample_tokens > 0:
        text = sample_from_checkpoint(ckpt, val_path, cfg.trainer.sample_tokens, seq_len=cfg.data.seq_len)
        print("modelpar-train: sample (prompt | continuation):\n" + text, flush=True)


register_schema()


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="train")
def _app(dcfg: DictConfig) -> None:
    cfg: TrainConfig = OmegaConf.to_object(dcfg)
    run(replace(cfg))


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
