"""Hugging Face OLMo 2 configs: ``Olmo2ForCausalLM`` <-> ``ModelConfig``.

OLMo 2 is a Llama whose norms come after each sub-layer (``x + norm(attn(x))``, ``model.block.norm=post``) and
whose QK-norm is one RMSNorm over each whole projection (``q_norm.weight`` [heads*d], ``k_norm.weight``
[kv_heads*d]: ``model.block.qk_norm_scope=projection``). Its tensors are named as ours (HF's without
``model.``). Every field transformers reads is read here; one this model cannot express is refused in one line
naming it.
"""

from __future__ import annotations

from modelpar.model.structure import BlockStructure

OLMO_TYPES = ("olmo2",)
OLMO2_BLOCK = BlockStructure(norm="post", qk_norm_scope="projection")


def olmo_unsupported(hf: dict) -> dict[str, bool]:
    """The OLMo 2 features this model does not implement, by config field (true: present in ``hf``)."""
    return {
        "attention_bias": bool(hf.get("attention_bias", False)),
        "attention_dropout": bool(hf.get("attention_dropout", 0.0)),
    }


def olmo_fields(hf: dict) -> dict:
    """The ``ModelConfig`` fields an ``olmo2`` config sets beyond Llama's."""
    return {"qk_norm": True, "block": BlockStructure(**OLMO2_BLOCK.changed())}


def olmo_config_to_hf(config, llama: dict) -> dict:
    """``config.json`` of ``Olmo2ForCausalLM`` from the Llama fields ``llama`` (``config_to_hf``'s). Raises
    ``ValueError`` (one line) for a model OLMo 2 cannot express."""
    changed, want = config.block.changed(), OLMO2_BLOCK.changed()
    bad = [f"block.{name}" for name in sorted(set(changed) | set(want)) if changed.get(name) != want.get(name)]
    bad += [name for name, on in (("qk_norm=false", not config.qk_norm), ("moe", config.moe.enabled)) if on]
    bad += ["sliding_window"] if config.sliding_window else []
    bad += ["attention_bias"] if config.attention_bias or config.attention_out_bias else []
    if bad:
        raise ValueError(
            f"OLMo 2 cannot express this model ({', '.join(bad)}); export needs OLMo 2's block (post-norms, QK-norm "
            "over whole projections), dense MLPs and full attention"
        )
    hf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "head_dim")}
    return hf | {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_dropout": 0.0}
