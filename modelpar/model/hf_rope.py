"""Hugging Face ``rope_parameters`` / ``rope_scaling`` <-> ``RopeScaling`` (``modelpar.model.rope``).

Read: ``rope_type`` (or the older ``type``) ``default``, ``linear`` (``factor``), ``llama3`` (``factor``,
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``) and ``yarn`` (``factor``,
``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``,
``original_max_position_embeddings``). As transformers does, a top-level ``original_max_position_embeddings``
wins over the one inside, which defaults to ``max_position_embeddings``; a YaRN without ``factor`` takes
``max_position_embeddings / original_max_position_embeddings``. Refused in one line: ``dynamic`` (the length
seen at inference changes the function), ``longrope`` and other types, and a ``partial_rotary_factor`` below 1.
Written: ``rope_parameters`` with ``rope_type``, ``rope_theta`` and the fields of that type.
"""

from __future__ import annotations

from modelpar.model.rope import DYNAMIC_REFUSED, ROPE_TYPES, RopeScaling

_DEFAULTS = RopeScaling()


def rope_parameters_of(hf: dict) -> dict:
    """The RoPE dict of a ``config.json`` (``rope_parameters``, or the older ``rope_scaling``), ``{}`` if none."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def rope_scaling_from_hf(hf: dict, path) -> RopeScaling:
    """The ``RopeScaling`` of a ``config.json`` (``hf``); ``ValueError`` (one line) for one modelpar does not
    compute."""
    rope = rope_parameters_of(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "dynamic":
        raise ValueError(f"{path}: rope_type={DYNAMIC_REFUSED}")
    if kind not in ROPE_TYPES:
        raise ValueError(f"{path}: rope_type={kind!r} is not supported; modelpar computes {', '.join(ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and partial != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor={partial} is not supported; modelpar rotates whole heads")
    if kind == "default":
        return RopeScaling()
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    original = int(original or hf.get("max_position_embeddings") or 0)
    factor = rope.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = hf["max_position_embeddings"] / original
    if factor is None:
        raise ValueError(f"{path}: rope_type={kind} needs a factor in rope_parameters")
    fields = {"type": kind, "factor": float(factor)}
    if kind in ("llama3", "yarn"):
        fields["original_max_position_embeddings"] = original
    if kind == "llama3":
        fields |= {name: float(rope[name]) for name in ("low_freq_factor", "high_freq_factor")}
    if kind == "yarn":
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if rope.get(name) is not None:
                fields[name] = float(rope[name])
        fields["truncate"] = bool(rope.get("truncate", True))
    scaling = RopeScaling(**fields)
    try:
        scaling.check()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return scaling


def rope_scaling_to_hf(scaling: RopeScaling, theta: float) -> dict:
    """``rope_parameters`` of ``config.json``: the type, theta and the fields the type reads (the yarn fields at
    their defaults, which transformers reads as absent, left out)."""
    out = {"rope_type": scaling.type, "rope_theta": theta}
    for name in scaling.fields():
        value = getattr(scaling, name)
        if scaling.type == "yarn" and name in ("mscale", "mscale_all_dim", "attention_factor") and not value:
            continue
        out[name] = value
    return out


__all__ = ["rope_parameters_of", "rope_scaling_from_hf", "rope_scaling_to_hf"]
