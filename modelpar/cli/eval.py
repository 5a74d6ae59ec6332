"""modelpar-eval: mean next-token cross-entropy of a checkpoint, under any layout.

    modelpar-eval eval.checkpoint=runs/x/checkpoints eval.windows=32 parallel=tp2-pp2

Scores the first ``eval.windows`` contiguous, non-overlapping windows of ``data.seq_len + 1`` tokens of
``data.path`` (the default corpus's held-out split when empty). The windows form one batch, split over dp
replicas and ``parallel.microbatches``, and run through the same pipeline runtime as training, forwards only
(the schedule's forwards in its order, without autograd); every window
has the same number of tokens, so the mean of micro-batch means is the mean over all tokens. The last line
printed is JSON: ``{"eval_loss": ..., "windows": ..., "tokens": ...}``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from modelpar import backends
from modelpar.backends import rank_setup
from modelpar.checkpoint.reshard import load_model_from_checkpoint
from modelpar.checkpoint.store import read_index, resolve_checkpoint
from modelpar.data import DataError, TokenFile, default_corpus
from modelpar.parallel.groups import ParallelGroups
from modelpar.parallel.launch import LaunchError, launch
from modelpar.pipeline import PipelineRuntime, forward_only
from modelpar.training.build import build_rank_model, resolve_device
from modelpar.training.config import RECIPES, RecipeError, TrainConfig, register_schema, validate
from modelpar.training.preflight import USER_ERRORS, runs_on_cpu


def eval_config(cfg: TrainConfig) -> TrainConfig:
    """The recipe with the eval windows as its one global batch (checked like a training recipe)."""
    if cfg.eval.windows < 1:
        raise RecipeError(f"eval.windows={cfg.eval.windows} must be >= 1")
    return replace(cfg, data=replace(cfg.data, global_batch=cfg.eval.windows))


def eval_worker(cfg: TrainConfig, data_path: str, ckpt: str, result_path: str) -> None:
    layout = cfg.parallel.layout()
    groups = ParallelGroups.build(layout)
    device = resolve_device(cfg)
    backends.install(groups, device, collectives=cfg.parallel.collectives, gloo_threads=cfg.trainer.gloo_threads)
    model = build_rank_model(cfg, groups, device)
    load_model_from_checkpoint(model.chunks, Path(ckpt), read_index(ckpt, verify=False))
    m = cfg.parallel.microbatches
    per_replica = cfg.eval.windows // layout.dp
    start = groups.dp_rank * per_replica
    tokens = TokenFile.open(data_path, cfg.model.vocab_size, cfg.data.seq_len)
    inputs, targets = tokens.batch(range(start, start + per_replica))
    runtime = PipelineRuntime(
        model.chunks,
        groups,
        forward_only(cfg.parallel.schedule, layout.pp, m, layout.vpp),
        activation_shape=model.chunks[0].activation_shape(per_replica // m, cfg.data.seq_len),
        loss_fn=model.chunks[-1].loss,
        device=device,
    )
    result = runtime.step(list(inputs.to(device).chunk(m)), list(targets.to(device).chunk(m)))
    loss = torch.tensor([result.loss], dtype=torch.float64)
    if layout.dp > 1:
        dist.all_reduce(loss, group=groups.dp_group)
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps({"eval_loss": loss.item() / layout.dp}))


def run(cfg: TrainConfig) -> dict:
    try:
        if not cfg.eval.checkpoint:
            raise RecipeError("eval.checkpoint is empty; pass eval.checkpoint=<run>/checkpoints or a step-* directory")
        ckpt = resolve_checkpoint(cfg.eval.checkpoint)
        index = read_index(ckpt, verify=True)
        saved = {k: v for k, v in index["model"].items() if k != "name"}
        mine = {k: v for k, v in vars(cfg.model).items() if k != "name"}
        if saved != mine:
            diff = sorted(k for k in saved if saved.get(k) != mine.get(k))
            raise RecipeError(f"{ckpt} holds a different model ({', '.join(diff)} differ); pick its model recipe")
        cfg = eval_config(cfg)
        validate(cfg)
        path = cfg.data.path or str(default_corpus(cfg.data.cache_dir, max_bytes=cfg.data.corpus_max_bytes).val_path)
        tokens = TokenFile.open(path, cfg.model.vocab_size, cfg.data.seq_len)
        if tokens.num_windows < cfg.eval.windows:
            raise DataError(f"{path} has {tokens.num_windows} windows, fewer than eval.windows={cfg.eval.windows}")
    except USER_ERRORS as exc:
        print(f"modelpar-eval: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "result.json")
        try:
            launch(
                cfg.parallel.layout().world_size,
                eval_worker,
                cfg,
                path,
                str(ckpt),
                result_path,
                timeout_s=cfg.trainer.timeout_s,
                threads_per_rank=cfg.trainer.threads_per_rank,
                rank_setup=rank_setup(runs_on_cpu(cfg), cfg.trainer.threads_per_rank, cfg.trainer.cpu_affinity),
            )
        except LaunchError as exc:
            print(f"modelpar-eval: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        result = json.loads(Path(result_path).read_text())
    result |= {"windows": cfg.eval.windows, "tokens": cfg.eval.windows * cfg.data.seq_len, "checkpoint": str(ckpt)}
    print(json.dumps(result), flush=True)
    return result


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="eval")
def _app(dcfg: DictConfig) -> None:
    run(OmegaConf.to_object(dcfg))


def main() -> None:
    register_schema()
    _app()


if __name__ == "__main__":
    main()
