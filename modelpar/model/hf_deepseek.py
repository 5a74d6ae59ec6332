"""Hugging Face DeepSeek-V3 configs and tensors: ``DeepseekV3ForCausalLM`` <-> ``ModelConfig``.

DeepSeek-V3 is multi-head latent attention (``model.mla``) in every layer, dense SwiGLUs of
``intermediate_size`` in layers ``0 .. first_k_dense_replace - 1`` and a mixture of experts in every later one:
``n_routed_experts`` experts of ``moe_intermediate_size``, top-``num_experts_per_tok`` by a sigmoid router with
its balancing bias (``e_score_correction_bias``; ``scoring_func=sigmoid``, ``topk_method=noaux_tc``),
group-limited to ``topk_group`` of ``n_group`` groups, renormalised (``norm_topk_prob``) and scaled by
``routed_scaling_factor``, plus ``n_shared_experts`` shared experts, one SwiGLU of ``n_shared_experts *
moe_intermediate_size`` (ours: ``moe.shared_experts`` of the expert width, the same SwiGLU). Every field
transformers reads is read here; one this model cannot express (``attention_bias``, ``num_key_value_heads`` !=
heads, another activation or scoring, a RoPE scaling ``modelpar.model.hf_rope`` refuses) is refused in one line
naming it. The released V3's YaRN block (factor 40, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1,
original_max_position_embeddings 4096) is read: scaled RoPE tables for q_pe and k_pe and the softmax scale
times ``m(40, 1)^2`` (``modelpar.model.rope``).

Tensors carry our logical names, which are HF's (``model.`` prefixed; experts one tensor each,
``mlp.experts.<e>.gate_proj|up_proj|down_proj.weight``, what transformers 5.x's ``save_pretrained`` writes; the
fused ``gate_up_proj`` / ``down_proj`` it holds in memory is read too, by ``modelpar.model.hf``). The router's
bias is ``mlp.gate.e_score_correction_bias``, both ways. With ``rope_interleave`` (V3's default and its released
weights) the RoPE rows of ``q_b_proj`` (or ``q_proj``) per head and of ``kv_a_proj_with_mqa`` hold interleaved
pairs: they are permuted to our rotate-half pairs on import (``halves_from_interleaved``) and back on export,
which always writes ``rope_interleave: true``, so an imported checkpoint exports to the same tensors.

Multi-token prediction: transformers' DeepseekV3 computes no MTP module (``num_nextn_predict_layers`` is read
by nothing but its config), so an import has ``mtp_depth=0`` whatever the file says; a model built with
``mtp_depth=D`` reads module k from DeepSeek's own layout ``model.layers.<layers + k>.*`` (``enorm``, ``hnorm``,
``eh_proj``, the block, ``shared_head.norm``), where an export with MTP writes it (transformers ignores it).
A dense latent-attention model exports as DeepSeek-V3 with ``first_k_dense_replace = layers`` (no MoE layer).
"""

from __future__ import annotations

import torch

from modelpar.model.config import MLAConfig, ModelConfig, MoEConfig
from modelpar.model.hf_qwen import qwen_expert_name
from modelpar.model.hf_rope import rope_parameters_of, rope_scaling_from_hf
from modelpar.model.layers.latent_attention import halves_from_interleaved, interleaved_from_halves

DEEPSEEK_TYPES = ("deepseek_v3",)


def deepseek_config_from_hf(hf: dict, path) -> ModelConfig:
    """The ``ModelConfig`` of a ``deepseek_v3`` ``config.json`` (``hf``); ``ValueError`` in one line naming
    the fields this model does not compute."""
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    rope = rope_parameters_of(hf)
    kv_heads = hf.get("num_key_value_heads") or heads
    unsupported = {
        "attention_bias": bool(hf.get("attention_bias", False)),
        "attention_dropout": bool(hf.get("attention_dropout", 0.0)),
        f"hidden_act={hf.get('hidden_act')}": hf.get("hidden_act", "silu") != "silu",
        f"num_key_value_heads={kv_heads} != num_attention_heads={heads}": kv_heads != heads,
        f"scoring_func={hf.get('scoring_func')}": hf.get("scoring_func", "sigmoid") != "sigmoid",
        f"topk_method={hf.get('topk_method')}": hf.get("topk_method", "noaux_tc") != "noaux_tc",
        f"moe_layer_freq={hf.get('moe_layer_freq')}": hf.get("moe_layer_freq", 1) != 1,
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"{path}: unsupported DeepSeek-V3 variant ({', '.join(bad)}); modelpar implements plain V3")
    dense = hf.get("first_k_dense_replace") or 0
    moe = MoEConfig()
    if dense < layers and hf.get("n_routed_experts"):
        moe = MoEConfig(
            experts=hf["n_routed_experts"],
            top_k=hf["num_experts_per_tok"],
            ffn_hidden=hf["moe_intermediate_size"],
            shared_experts=hf.get("n_shared_experts") or 0,
            router="sigmoid",
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            first_k_dense_replace=dense,
        )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden=hf["hidden_size"],
        layers=layers,
        heads=heads,
        kv_heads=heads,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 4096),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling_from_hf(hf, path),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
        mla=MLAConfig(
            kv_lora_rank=hf["kv_lora_rank"],
            q_lora_rank=hf.get("q_lora_rank") or 0,
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
        ),
        moe=moe,
    )


def deepseek_config_to_hf(config: ModelConfig, llama: dict) -> dict:
    """``config.json`` of ``DeepseekV3ForCausalLM`` for a latent-attention model, from the fields it shares with
    Llama (``llama``: ``config_to_hf``'s for the model without latent attention, experts or MTP); ``ValueError``
    (one line) for what V3 cannot express (a softmax router, MoE layers that are not every layer from the first
    MoE one on)."""
    moe, m, layers = config.moe, config.mla, config.layers
    moe_layers = [i for i in range(layers) if moe.is_moe_layer(i)]
    first = moe_layers[0] if moe_layers else layers
    unsupported = {
        f"model.moe.router={moe.router} (V3's is sigmoid)": moe.enabled and moe.router != "sigmoid",
        f"MoE layers {moe_layers} (V3: every layer from first_k_dense_replace on)": moe_layers
        != list(range(first, layers)),
        f"model.moe.n_group={moe.n_group} with groups of one expert (V3 scores a group by its top two)": moe.enabled
        and moe.experts // moe.n_group < 2,
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"DeepSeek-V3 cannot express this model ({', '.join(bad)})")
    routing = dict(
        n_routed_experts=moe.experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=config.expert_ffn_hidden,
        n_shared_experts=moe.shared_experts,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=moe.norm_topk_prob,
    )
    if not moe.enabled:  # every layer dense: the MoE fields are read by nothing
        routing = dict(
            n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=config.ffn_hidden, n_shared_experts=0,
            n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        )  # fmt: skip
    shared = {k: v for k, v in llama.items() if k not in ("head_dim", "mlp_bias")}
    return shared | {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": config.heads,
        "first_k_dense_replace": first,
        **routing,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank or None,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_interleave": True,
        "num_nextn_predict_layers": config.mtp_depth,
        "attention_dropout": 0.0,
    }


def deepseek_name(logical: str, layers: int) -> str:
    """DeepSeek-V3's key of a logical tensor: an expert's ``...experts.5.w1.weight`` -> ``...5.gate_proj.weight``,
    MTP module k's ``mtp.<k>.X`` -> ``model.layers.<layers + k>.X`` (its final norm ``shared_head.norm``)."""
    if ".mlp.experts." in logical:
        logical = qwen_expert_name(logical)
    if logical.startswith("mtp."):
        _, k, rest = logical.split(".", 2)
        rest = "shared_head.norm.weight" if rest == "norm.weight" else rest
        logical = f"layers.{layers + int(k)}.{rest}"
    return logical if logical == "lm_head.weight" else f"model.{logical}"


def rope_head_dim(logical: str, mla: MLAConfig) -> int | None:
    """Rows per head of a tensor whose last ``qk_rope_head_dim`` rows per head are RoPE rows (q_b_proj, q_proj:
    qk_nope + qk_rope; kv_a_proj_with_mqa: one head of kv_lora_rank + qk_rope), or None."""
    if logical.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        return mla.qk_head_dim
    if logical.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        return mla.kv_lora_rank + mla.qk_rope_head_dim
    return None


def rope_rows_from_hf(logical: str, weight: torch.Tensor, mla: MLAConfig) -> torch.Tensor:
    """A whole interleaved-RoPE (``rope_interleave``) tensor in our rotate-half row order (others unchanged)."""
    head_dim = rope_head_dim(logical, mla)
    return weight if head_dim is None else halves_from_interleaved(weight, mla.qk_rope_head_dim, head_dim)


def rope_rows_to_hf(logical: str, weight: torch.Tensor, mla: MLAConfig) -> torch.Tensor:
    """The inverse of ``rope_rows_from_hf``: our rotate-half rows back to interleaved pairs."""
    head_dim = rope_head_dim(logical, mla)
    return weight if head_dim is None else interleaved_from_halves(weight, mla.qk_rope_head_dim, head_dim)


__all__ = [
    "DEEPSEEK_TYPES",
    "deepseek_config_from_hf",
    "deepseek_config_to_hf",
    "deepseek_name",
    "rope_head_dim",
    "rope_rows_from_hf",
    "rope_rows_to_hf",
]
