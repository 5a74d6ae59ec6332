"""Everything a job checks before any rank starts: the recipe, its layout and schedule, the data, the checkpoint.

    train_path, val_path, resume_from = preflight(cfg)   # raises one of USER_ERRORS, one line naming the fix

``modelpar-train``, ``modelpar-eval`` and ``modelpar-bench`` run these in the launching process, so that a bad
recipe is one line on stderr rather than a traceback from every rank.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from modelpar.checkpoint.signing import check_checkpoint, load_key, read_signed_index
from modelpar.checkpoint.store import (
    CheckpointError,
    checkpoint_dirs,
    latest_checkpoint,
    read_index,
    resolve_checkpoint,
)
from modelpar.data import (
    Blend,
    DataError,
    TokenFile,
    WindowSet,
    default_corpus,
    eval_split,
    open_blend,
    open_dataset,
)
from modelpar.data.fingerprint import check_same_data
from modelpar.parallel.layout import LayoutError
from modelpar.parallel.secret_file import SecretFileError
from modelpar.pipeline import PartitionError, ScheduleError, build_schedule
from modelpar.training.build import build_partition, resolve_eos_id
from modelpar.training.config import RecipeError, TrainConfig, validate
from modelpar.training.resume_identity import check_resume_identity
from modelpar.training.security import record
from modelpar.training.torch_version import UntestedTorchError, check_torch_version

# what a user can fix in the recipe, the data or the checkpoint: reported in one line, never as a traceback
USER_ERRORS = (
    RecipeError,
    LayoutError,
    DataError,
    ScheduleError,
    PartitionError,
    CheckpointError,
    UntestedTorchError,
    ValueError,
    SecretFileError,
)


def resolve_data(cfg: TrainConfig) -> tuple[str | Blend, str]:
    """Training data (a token file, shard directory or ``Blend``) and a validation set; the default corpus is
    built (once) when neither ``data.path`` nor ``data.blend`` is given. A shard directory's validation set is
    its held-out split; a blend's is that of its first dataset (``modelpar-eval`` scores each one's)."""
    d = cfg.data
    if d.blend:
        blend = Blend.of([(entry.path, entry.weight) for entry in d.blend])
        return blend, d.val_path or eval_split(blend.paths[0])
    if d.path:
        return d.path, d.val_path or eval_split(d.path)
    info = default_corpus(d.cache_dir, max_bytes=d.corpus_max_bytes)
    return str(info.path), str(info.val_path)


def open_windows(cfg: TrainConfig, train_path: str | Blend) -> TokenFile | WindowSet:
    """The windows of the training data, checked against the model (vocabulary, seq_len, tokenizers)."""
    if isinstance(train_path, Blend):
        return open_blend(train_path, cfg.model.vocab_size, cfg.data.seq_len)[0]
    return open_dataset(train_path, cfg.model.vocab_size, cfg.data.seq_len)


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
    key = load_key(cfg.trainer.signing_key or None)
    if mode == "auto":
        found = newest_good_checkpoint(Path(cfg.trainer.out_dir) / "checkpoints")
        if found is not None and key is not None:
            check_checkpoint(found, key)  # a bad signature is refused, never skipped for an older checkpoint
        return str(found) if found else None
    ckpt = resolve_checkpoint(mode) if Path(mode).is_dir() else mode  # a root: the checkpoint latest names
    read_signed_index(ckpt, key)  # verify before starting ranks
    return str(ckpt)


def newest_good_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` that verifies; each one skipped is named with the reason."""
    if not root.is_dir():
        return None
    for debris in sorted(root.glob("step-*.tmp")):
        print(f"modelpar-train: ignoring {debris}: a save that did not complete", file=sys.stderr)
    for ckpt in reversed(checkpoint_dirs(root)):
        try:
            read_index(ckpt, verify=True)
        except CheckpointError as exc:
            aside = ckpt.with_name(ckpt.name + ".corrupt")
            with contextlib.suppress(OSError):  # under torchrun every rank checks; one of them moves it
                ckpt.rename(aside)  # kept for inspection; the run will write this step again
            line = f"skipping {ckpt.name} (moved to {aside.name}): {exc}"
            record(root.parent, "tampered-checkpoint", None, line)
            print(f"modelpar-train: {line}", file=sys.stderr)
            continue
        return ckpt
    return None


def runs_on_cpu(cfg: TrainConfig) -> bool:
    """Whether the ranks will compute on CPU cores (``trainer.device`` cpu, or auto without CUDA)."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device == "cpu"
    return not torch.cuda.is_available()


def check_recipe(cfg: TrainConfig) -> None:
    """The recipe alone: fields, layout against the model, schedule against the micro-batches, partition."""
    validate(cfg)
    build_schedule(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.microbatches, cfg.parallel.vpp)
    build_partition(cfg)


def check_device(cfg: TrainConfig) -> None:
    """The device the recipe asks for exists, and what it implies (NCCL runs its own collectives)."""
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise RecipeError(
            "trainer.device=cuda but no CUDA device is visible (or this torch has no CUDA); "
            "use trainer.device=auto or cpu, or install a CUDA build of torch"
        )
    if cfg.parallel.collectives == "exchange" and not runs_on_cpu(cfg):
        raise RecipeError(
            "parallel.collectives=exchange runs on gloo (CPU ranks) only; on GPUs NCCL's own collectives run: "
            "use parallel.collectives=auto or native"
        )


def preflight(cfg: TrainConfig) -> tuple[str | Blend, str, str | None]:
    """Every check that needs no rank: torch, recipe, device, layout, schedule, data, checkpoint (its hashes, its
    model's identity against the recipe's, its data's fingerprint)."""
    check_torch_version()
    check_recipe(cfg)
    check_device(cfg)
    train_path, val_path = resolve_data(cfg)
    tokens = open_windows(cfg, train_path)
    if tokens.num_windows < cfg.data.global_batch:
        raise DataError(
            f"{train_path} has {tokens.num_windows} windows of {cfg.data.seq_len + 1} tokens, fewer than "
            f"data.global_batch={cfg.data.global_batch}; use more data or a smaller batch"
        )
    resolve_eos_id(cfg, train_path)  # data.document_mask needs an EOS id: named here, before any rank
    resume_from = resolve_resume(cfg)
    if resume_from is not None:
        index = read_index(resume_from, verify=False)
        check_resume_identity(cfg.model, index.get("model"), resume_from)
        check_same_data(index.get("data_fingerprint"), train_path, cfg.data.allow_changed, resume_from)
    return train_path, val_path, resume_from
