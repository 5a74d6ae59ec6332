"""modelpar-eval: mean next-token cross-entropy of a checkpoint, under any layout.

    modelpar-eval eval.checkpoint=runs/x/checkpoints eval.windows=32 parallel=tp2-pp2

The model's shape comes from the checkpoint (a field set on the command line must agree with it). Scores the
first ``eval.windows`` windows of ``data.seq_len + 1`` tokens (neighbours share one token) of
``data.val_path``, else the held-out split of ``data.path`` (a shard directory's ``val/``; a token file is
scored itself), else the held-out split of the training data the checkpoint records (one that records none is
refused); the data scored is printed first. A ``data.blend`` is scored on each dataset's held-out
split; the JSON line then has each one's loss and their mean weighted by the blend. The windows form one
batch, split over dp replicas and ``parallel.microbatches``, and run through the same pipeline runtime as
training, forwards only (the schedule's forwards in its order, without autograd); every window has the same
number of tokens, so the mean of micro-batch means is the mean over all tokens. The last line
printed is JSON: ``{"eval_loss": ..., "windows": ..., "tokens": ...}``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from modelpar import backends
from modelpar.backends import rank_setup
from modelpar.checkpoint.reshard import load_model_from_checkpoint
from modelpar.checkpoint.signing import load_key, read_signed_index
from modelpar.checkpoint.store import read_index, resolve_checkpoint
from modelpar.cli.overrides import refuse_unknown_overrides
from modelpar.data import DataError, eval_split, open_dataset
from modelpar.model.config import ATTENTION_VARIANT, IDENTITY, MLAConfig, ModelConfig, MoEConfig
from modelpar.model.moe_config import ROUTING_DEFAULTS
from modelpar.parallel.context import document_ids, split_for_context
from modelpar.parallel.groups import ParallelGroups
from modelpar.parallel.launch import LaunchError, launch
from modelpar.pipeline import PipelineRuntime, forward_only
from modelpar.training.build import build_rank_model, resolve_device, resolve_eos_id
from modelpar.training.config import RECIPES, BlendEntry, RecipeError, TrainConfig, register_schema, validate
from modelpar.training.preflight import USER_ERRORS, runs_on_cpu
from modelpar.training.torch_version import check_torch_version


def eval_config(cfg: TrainConfig, microbatches_set: bool = True) -> TrainConfig:
    """The recipe with the eval windows as its one global batch (checked like a training recipe). Unless the
    user set ``parallel.microbatches``, the count is the largest up to the recipe's that divides each dp
    replica's windows (a multiple of pp for the interleaved schedule), and it is said which."""
    if cfg.eval.windows < 1:
        raise RecipeError(f"eval.windows={cfg.eval.windows} must be >= 1")
    p = cfg.parallel
    if not microbatches_set and cfg.eval.windows % p.dp == 0:
        per_replica = cfg.eval.windows // p.dp
        fits = [
            m
            for m in range(min(p.microbatches, per_replica), 0, -1)
            if per_replica % m == 0 and (p.schedule != "interleaved" or m % p.pp == 0)
        ]
        if fits and fits[0] != p.microbatches:
            print(
                f"modelpar-eval: parallel.microbatches={fits[0]} (the recipe's {p.microbatches} does not divide the "
                f"{per_replica} windows per dp replica)",
                flush=True,
            )
            cfg = replace(cfg, parallel=replace(p, microbatches=fits[0]))
    return replace(cfg, data=replace(cfg.data, global_batch=cfg.eval.windows))


def model_of_checkpoint(cfg: TrainConfig, saved: dict, overridden: Mapping[str, str], ckpt: Path) -> ModelConfig:
    """The model to evaluate: the checkpoint's shape (its ``IDENTITY`` fields, those of its ``moe`` section,
    ``max_seq_len`` if the run's sequence fits, its ``mla`` section unless the run sets one, and the attention
    variant ``ATTENTION_VARIANT``: its sliding window), except fields the user set on the command line
    (``overridden``: key -> value, e.g. ``model.hidden`` or the group choice ``model``), which must then agree
    with it; every field that differs is named, with the override that set it. How the model runs
    (``kernels``, ``compile``), ``init_std`` and the MoE training settings come from the recipe."""
    mine, group = cfg.model, overridden.get("model")
    saved_moe = saved.get("moe") or {}
    fields = [
        (name, saved.get(name), _plain(getattr(mine, name)), f"model.{name}") for name in IDENTITY if name in saved
    ]
    fields += [
        (f"moe.{name}", saved_moe.get(name), getattr(mine.moe, name), f"model.moe.{name}")
        for name in MoEConfig.IDENTITY
        if name in saved_moe
    ]
    if saved_moe:  # routing fields are saved only where they differ from their defaults
        fields += [
            (f"moe.{name}", saved_moe.get(name, default), getattr(mine.moe, name), f"model.moe.{name}")
            for name, default in ROUTING_DEFAULTS.items()
        ]
    differ, taken, moe_taken = [], {}, {}
    for name, theirs, ours, key in fields:
        chosen = key in overridden or (name.startswith("moe.") and "model.moe" in overridden) or group is not None
        if not chosen:
            (moe_taken if name.startswith("moe.") else taken)[name.removeprefix("moe.")] = theirs
        elif theirs != ours:
            differ.append((name, theirs, ours, key if key in overridden else f"model={group}"))
    if differ:
        held = ", ".join(f"{name}={theirs!r}" for name, theirs, _, _ in differ)
        by_group = [f"{name}={ours!r}" for name, _, ours, by in differ if by.startswith("model=")]
        by_field = [f"{by}={ours!r}" for _, _, ours, by in differ if not by.startswith("model=")]
        given = " and ".join(
            ([f"model={group} gives {', '.join(by_group)}"] if by_group else [])
            + ([f"this run sets {', '.join(by_field)}"] if by_field else [])
        )
        drop = ", ".join(dict.fromkeys(by for *_, by in differ))
        raise RecipeError(
            f"{ckpt} holds a model with {held}, but {given}; drop {drop} (the checkpoint's model is used by default)"
        )
    if "max_seq_len" in saved and "model.max_seq_len" not in overridden and group is None:
        taken["max_seq_len"] = max(saved["max_seq_len"], cfg.data.seq_len)
    for name in ATTENTION_VARIANT:  # the function the checkpoint computes, though not its weights' identity
        if name in saved and f"model.{name}" not in overridden and group is None:
            taken[name] = saved[name]
    if "name" in saved:
        taken["name"] = saved["name"]
    if moe_taken:
        taken["moe"] = replace(mine.moe, **moe_taken)
    mla_set = any(key == "model.mla" or key.startswith("model.mla.") for key in overridden)
    if saved.get("mla") and not mla_set and group is None:  # latent attention's shape, saved only when on
        taken["mla"] = MLAConfig(**saved["mla"])
    return replace(mine, **taken)


def _plain(value):
    """A field as a checkpoint's index holds it (a dataclass such as ``rope_scaling`` as its dict)."""
    return asdict(value) if is_dataclass(value) else value


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
    tokens = open_dataset(data_path, cfg.model.vocab_size, cfg.data.seq_len)
    inputs, targets = tokens.batch(range(start, start + per_replica))
    runtime = PipelineRuntime(
        model.chunks,
        groups,
        forward_only(cfg.parallel.schedule, layout.pp, m, layout.vpp),
        activation_shape=model.chunks[0].activation_shape(per_replica // m, cfg.data.seq_len),
        loss_fn=model.chunks[-1].loss,
        device=device,
    )
    if cfg.data.document_mask:  # scored as trained: each token sees only its own document
        documents = document_ids(inputs, resolve_eos_id(cfg, data_path)).to(device).chunk(m)
        for chunk in model.chunks:
            chunk.documents.source = lambda: documents[runtime.current.micro_batch]
    cp = model.chunks[0].cp  # under context parallelism each rank scores its two chunks of every window
    inputs, targets = split_for_context(inputs, cp), split_for_context(targets, cp)
    result = runtime.step(list(inputs.to(device).chunk(m)), list(targets.to(device).chunk(m)))
    loss = torch.tensor([result.loss], dtype=torch.float64)
    replicas = layout.dp * layout.cp  # equal token counts: the mean of their means is the mean
    if replicas > 1:
        dist.all_reduce(loss, group=groups.dp_cp_group)
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps({"eval_loss": loss.item() / replicas}))


def run(cfg: TrainConfig, overridden: Mapping[str, str] | None = None) -> dict:
    """``overridden``: what the user set on the command line, key -> value (``model.hidden``, or ``model`` for
    a whole model recipe); everything else about the model's shape comes from the checkpoint."""
    overridden = overridden or {}
    try:
        check_torch_version()
        if not cfg.eval.checkpoint:
            raise RecipeError("eval.checkpoint is empty; pass eval.checkpoint=<run>/checkpoints or a step-* directory")
        ckpt = resolve_checkpoint(cfg.eval.checkpoint)
        index = read_signed_index(ckpt, load_key(cfg.trainer.signing_key or None))
        cfg = replace(cfg, model=model_of_checkpoint(cfg, index["model"], overridden, ckpt))
        cfg = eval_config(cfg, microbatches_set="parallel.microbatches" in overridden or "parallel" in overridden)
        cfg, recorded = data_of_checkpoint(cfg, index, ckpt)
        validate(cfg)
        sets = eval_sets(cfg)
        scored = ", ".join(path for path, _ in sets)
        print(f"modelpar-eval: scoring {scored}" + (f" ({recorded})" if recorded else ""), flush=True)
        for path, _ in sets:
            tokens = open_dataset(path, cfg.model.vocab_size, cfg.data.seq_len)
            if tokens.num_windows < cfg.eval.windows:
                raise DataError(f"{path} has {tokens.num_windows} windows, fewer than eval.windows={cfg.eval.windows}")
    except USER_ERRORS as exc:
        print(f"modelpar-eval: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    losses = {path: _evaluate(cfg, path, ckpt)["eval_loss"] for path, _ in sets}
    if len(sets) == 1:
        result = {"eval_loss": losses[sets[0][0]]}
    else:
        total = sum(weight for _, weight in sets)
        result = {"eval_loss": sum(losses[p] * w for p, w in sets) / total, "eval_loss_by_dataset": losses}
    result |= {"windows": cfg.eval.windows, "tokens": cfg.eval.windows * cfg.data.seq_len, "checkpoint": str(ckpt)}
    print(json.dumps(result), flush=True)
    return result


def data_of_checkpoint(cfg: TrainConfig, index: dict, ckpt: Path) -> tuple[TrainConfig, str]:
    """The recipe with the data to score: as given (``data.val_path``, ``data.blend`` or ``data.path``), else the
    training data the checkpoint records (its held-out split), with a note saying so; a checkpoint that records
    none is refused rather than scored on a default corpus it may never have seen."""
    d = cfg.data
    if d.val_path or d.blend or d.path:
        return cfg, ""
    source = index.get("data")
    if isinstance(source, dict) and isinstance(source.get("path"), str):
        return replace(cfg, data=replace(d, path=source["path"])), f"the held-out split of what {ckpt} trained on"
    if isinstance(source, dict) and isinstance(source.get("blend"), list):
        try:
            blend = [BlendEntry(path=str(path), weight=float(weight)) for path, weight in source["blend"]]
        except (TypeError, ValueError):
            blend = []
        if blend:
            return replace(cfg, data=replace(d, blend=blend)), f"the held-out splits of the blend {ckpt} trained on"
    raise RecipeError(
        f"{ckpt} does not record the data it was trained on (saved by an older modelpar); pass data.path=<its "
        "training data> (its held-out split is scored) or data.val_path=<a token file>"
    )


def eval_sets(cfg: TrainConfig) -> list[tuple[str, float]]:
    """What to score, with weights: ``data.val_path``; each blend dataset's held-out split; the held-out split
    of ``data.path`` (or the file itself)."""
    d = cfg.data
    if d.val_path:
        return [(d.val_path, 1.0)]
    if d.blend:
        return [(eval_split(e.path), e.weight) for e in d.blend]
    return [(eval_split(d.path), 1.0)]


def _evaluate(cfg: TrainConfig, path: str, ckpt: Path) -> dict:
    """One launch of the eval ranks on ``path``."""
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
        return json.loads(Path(result_path).read_text())


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="eval")
def _app(dcfg: DictConfig) -> None:
    overrides = HydraConfig.get().overrides.task  # what the user set, e.g. "model.hidden=32" or "model=tiny"
    run(OmegaConf.to_object(dcfg), dict((o.split("=", 1) + [""])[:2] for o in (o.lstrip("+~") for o in overrides)))


def main() -> None:
    refuse_unknown_overrides("modelpar-eval", TrainConfig, RECIPES)
    register_schema()
    _app()


if __name__ == "__main__":
    main()
