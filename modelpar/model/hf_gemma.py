"""Hugging Face Gemma 3 (text) and Gemma 2 configs: ``Gemma3ForCausalLM`` (``model_type`` gemma3_text) and
``Gemma2ForCausalLM`` <-> ``ModelConfig``.

Gemma 3's layer is a sandwich (a norm before and after each sub-layer, ``model.block.norm=sandwich``) of RMSNorms
scaled by ``1 + weight`` (``norm_offset=1``), with a GeGLU MLP (``gelu_pytorch_tanh``), the embedding multiplied
by sqrt(hidden), per-head QK-norm, scores scaled by ``query_pre_attn_scalar ** -0.5`` (``query_scale``) and
the logits soft-capped where the config says (``final_logit_softcapping``; transformers' Gemma 3 reads
``attn_logit_softcapping`` but applies no cap to the scores, so a config setting it is refused); its layers are
sliding-window (local) or full (global) by ``layer_types``, each kind with its own RoPE base
(``rope_parameters.sliding_attention`` / ``full_attention``: ``local_rope_theta`` / ``rope_theta`` and
``rope_scaling``, the global layers' alone, as Gemma 3's linear factor 8); its
embeddings are tied by default. Gemma 2 is the same block without QK-norm, one RoPE base for every layer, and
its scores soft-capped (``attn_logit_softcapping``: ``attention_softcap``). Tensors are named as ours (HF's
without ``model.``). Every field transformers reads is read here; one this model cannot express is refused in
one line naming it.
"""

from __future__ import annotations

from modelpar.model.hf_rope import rope_scaling_from_hf, rope_scaling_to_hf
from modelpar.model.structure import BlockStructure

GEMMA_TYPES = ("gemma3_text", "gemma2")
GEMMA3_BLOCK = BlockStructure(norm="sandwich", norm_offset=1.0, activation="geglu", embedding_scale=True)
# what the export may set besides GEMMA3_BLOCK's fields (the other fields are Llama's, which Gemma 3 is not)
FREE = {"gemma3_text": ("query_scale", "final_softcap", "local_rope_theta"),
        "gemma2": ("query_scale", "attention_softcap", "final_softcap")}  # fmt: skip


def gemma_rope(hf: dict) -> tuple[dict, dict]:
    """(global, local) RoPE parameters of a Gemma 3 config: ``rope_parameters`` per layer type, or the older
    top-level ``rope_theta`` / ``rope_local_base_freq``; a Gemma 2's one set, twice."""
    rope = hf.get("rope_parameters") or {}
    if hf.get("model_type") == "gemma2":
        one = rope or {"rope_theta": hf.get("rope_theta", 10_000.0)}
        return one, one
    full = rope.get("full_attention") or {"rope_theta": hf.get("rope_theta", 1_000_000.0)}
    local = rope.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    return full, local


def gemma_unsupported(hf: dict) -> dict[str, bool]:
    """The Gemma 3 features this model does not implement, by config field (true: present in ``hf``)."""
    full, local = gemma_rope(hf)
    return {
        "hidden_activation": hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
        "use_bidirectional_attention": bool(hf.get("use_bidirectional_attention", False)),
        "attention_dropout": bool(hf.get("attention_dropout", 0.0)),
        "attention_bias": bool(hf.get("attention_bias", False)),
        "attn_logit_softcapping": hf.get("model_type") != "gemma2" and bool(hf.get("attn_logit_softcapping")),
        "rope_type": local is not full and local.get("rope_type", local.get("type", "default")) != "default",
    }


def gemma_fields(hf: dict, window: dict, path) -> dict:
    """The ``ModelConfig`` fields a ``gemma3_text`` or ``gemma2`` config sets beyond Llama's; ``window``: its
    ``sliding_window`` / ``window_layers`` (``modelpar.model.hf``)."""
    full, local = gemma_rope(hf)
    gemma3 = hf.get("model_type") == "gemma3_text"
    block = BlockStructure(
        **GEMMA3_BLOCK.changed(),
        query_scale=float(hf.get("query_pre_attn_scalar", 256)),
        attention_softcap=0.0 if gemma3 else float(hf.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        local_rope_theta=float(local["rope_theta"]) if gemma3 and window.get("sliding_window") else 0.0,
    )
    return {
        "qk_norm": gemma3,
        "rope_theta": float(full["rope_theta"]),
        "rope_scaling": rope_scaling_from_hf(hf | {"rope_parameters": full}, path),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
        "block": block,
        **window,
    }


def gemma_config_to_hf(config, llama: dict) -> dict:
    """``config.json`` of ``Gemma3ForCausalLM`` (with QK-norm) or ``Gemma2ForCausalLM`` (without) from the Llama
    fields ``llama`` (``config_to_hf``'s of the same shape). Raises ``ValueError`` (one line) for a model the
    family cannot express."""
    b, want, changed = config.block, GEMMA3_BLOCK.changed(), config.block.changed()
    kind, family = ("gemma3_text", "Gemma 3") if config.qk_norm else ("gemma2", "Gemma 2")
    bad = [f"block.{name}" for name, value in changed.items() if name not in FREE[kind] and want.get(name) != value]
    bad += [f"block.{name}" for name in want if name not in changed]
    bad += ["block.qk_norm_scope"] if b.qk_norm_scope != "head" else []
    bad += ["moe"] if config.moe.enabled else []
    bad += ["attention_bias"] if config.attention_bias or config.attention_out_bias else []
    if bad:
        raise ValueError(
            f"{family} cannot express this model ({', '.join(bad)}); export needs its block (sandwich norms scaled "
            "by 1 + weight, GeGLU, scaled embedding, per-head QK-norm for Gemma 3) and dense MLPs"
        )
    if kind == "gemma2":
        return _gemma2(config, llama)
    layers = range(config.layers)
    hf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "hidden_act", "rope_parameters")}
    full = rope_scaling_to_hf(config.rope_scaling, config.rope_theta)
    local = {"rope_type": "default", "rope_theta": b.local_rope_theta} if b.local_rope_theta else full
    scalar = b.query_scale or config.head_size
    return hf | {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,  # transformers' type
        "attn_logit_softcapping": None,  # transformers' Gemma 3 applies none
        "final_logit_softcapping": b.final_softcap or None,
        "sliding_window": config.sliding_window or None,
        "layer_types": ["sliding_attention" if config.window(i) else "full_attention" for i in layers],
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
    }


def _gemma2(config, llama: dict) -> dict:
    b, scalar = config.block, config.block.query_scale or config.head_size
    hf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "hidden_act")}
    return hf | {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "attn_logit_softcapping": b.attention_softcap or None,
        "final_logit_softcapping": b.final_softcap or None,
        "sliding_window": config.sliding_window or None,
        "layer_types": ["sliding_attention" if config.window(i) else "full_attention" for i in range(config.layers)],
        "attention_dropout": 0.0,
    }
