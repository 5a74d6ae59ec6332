"""A resumed run trains the model its checkpoint holds, or stops before any rank starts.

    check_resume_identity(cfg.model, read_index(ckpt)["model"], ckpt)   # RecipeError: one line

The identity is ``ModelConfig.identity()`` (the fields that change what the weights mean, with the ``moe`` and
``mla`` shapes): a recipe that differs on any of them would load some weights under another meaning, drop others
(an untied head, the q/k norms) and record its own values in the next checkpoint's index. Every differing field
is named with the checkpoint's value, so the fix is the line's last clause. How the model runs (kernels, compile,
fp8), ``init_std``, ``max_seq_len`` and the sliding window are not identity and may change on resume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from modelpar.model.config import MLAConfig, ModelConfig, MoEConfig
from modelpar.training.config import RecipeError


def saved_model(saved: dict) -> ModelConfig:
    """The ``ModelConfig`` a checkpoint index's ``model`` section describes (fields it predates take their
    defaults, which is what its weights mean; keys this version does not know are ignored)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: v for k, v in saved.items() if k in known and k not in ("moe", "mla")}
    moe_known = {f.name for f in dataclasses.fields(MoEConfig)}
    mla_known = {f.name for f in dataclasses.fields(MLAConfig)}
    moe = MoEConfig(**{k: v for k, v in (saved.get("moe") or {}).items() if k in moe_known})
    mla = MLAConfig(**{k: v for k, v in (saved.get("mla") or {}).items() if k in mla_known})
    return ModelConfig(**fields, moe=moe, mla=mla)


def _flat(identity: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in identity.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def identity_differences(mine: ModelConfig, saved: dict) -> list[tuple[str, object, object]]:
    """(field, checkpoint's value, recipe's value) for every identity field on which they differ."""
    theirs, ours = _flat(saved_model(saved).identity()), _flat(mine.identity())
    missing = object()
    return [
        (name, theirs.get(name, missing), ours.get(name, missing))
        for name in dict.fromkeys([*theirs, *ours])
        if theirs.get(name, missing) != ours.get(name, missing)
    ]


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if type(value).__name__ != "object" else "(none)"


def check_resume_identity(mine: ModelConfig, saved: dict | None, ckpt: str | Path) -> None:
    """Raise ``RecipeError`` naming every identity field on which the recipe's model and the checkpoint's differ."""
    if not saved:
        return  # an index written before models were recorded: nothing to compare
    differ = identity_differences(mine, saved)
    if not differ:
        return
    held = ", ".join(f"{name}={_shown(theirs)}" for name, theirs, _ in differ)
    given = ", ".join(f"{name}={_shown(ours)}" for name, _, ours in differ)
    fix = " ".join(f"model.{name}={_shown(theirs)}" for name, theirs, _ in differ if _shown(theirs) != "(none)")
    raise RecipeError(
        f"{ckpt} holds a model with {held}, but this run's model has {given}; to resume it set "
        f"{fix or 'the same model'}, or train the new model in another trainer.out_dir (hydra.run.dir)"
    )
