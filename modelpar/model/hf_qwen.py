"""Hugging Face Qwen3 and Qwen3-MoE configs: ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` <-> ``ModelConfig``.

Qwen3 is a Llama with QK-norm (``model.qk_norm``) and a head width of its own (``head_dim``); Qwen3-MoE puts
a mixture of experts without shared experts in the MLP of layer ``i`` when ``i`` is not in ``mlp_only_layers``
and ``(i + 1) % decoder_sparse_step == 0`` (the other layers are dense SwiGLUs of ``intermediate_size``). Every
field transformers reads is read here; one this model cannot express is refused in one line naming it. The
tensors are named as for Llama (``modelpar.model.hf``), a Qwen3-MoE expert ``e`` of layer ``i`` as
``model.layers.<i>.mlp.experts.<e>.gate_proj|up_proj|down_proj.weight`` (our ``w1``, ``w3``, ``w2``).
"""

from __future__ import annotations

from modelpar.model.config import ModelConfig, MoEConfig

QWEN_TYPES = ("qwen3", "qwen3_moe")
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # ours -> Qwen3-MoE's


def moe_layers_of(layers: int, step: int, mlp_only: list[int]) -> list[int]:
    """The Qwen3-MoE layers whose MLP is a mixture of experts."""
    return [i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0]


def qwen_unsupported(hf: dict) -> dict[str, bool]:
    """The Qwen3 features this model does not implement, by config field (true: present in ``hf``)."""
    return {
        "use_sliding_window": bool(hf.get("use_sliding_window", False)),
        "layer_types": any(kind != "full_attention" for kind in hf.get("layer_types") or []),
        "attention_dropout": bool(hf.get("attention_dropout", 0.0)),
        "shared_expert_intermediate_size": bool(hf.get("shared_expert_intermediate_size", 0)),
    }


def qwen_moe_config(hf: dict, layers: int) -> MoEConfig:
    """The mixture of experts of a ``qwen3_moe`` config (dense, ``MoEConfig()``, when no layer has one)."""
    experts = hf.get("num_experts", hf.get("num_local_experts", 0))
    step = hf.get("decoder_sparse_step", 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be >= 1")
    sparse = moe_layers_of(layers, step, list(hf.get("mlp_only_layers") or []))
    if not experts or not sparse:
        return MoEConfig()
    return MoEConfig(
        experts=experts,
        top_k=hf["num_experts_per_tok"],
        ffn_hidden=hf["moe_intermediate_size"],
        layers=[] if len(sparse) == layers else sparse,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0,
    )


def qwen_config_to_hf(config: ModelConfig, llama: dict) -> dict:
    """``config.json`` of ``Qwen3ForCausalLM`` (dense) or ``Qwen3MoeForCausalLM`` from the Llama fields
    ``llama`` (``config_to_hf``'s); the MoE layers are written as ``mlp_only_layers`` (the complement), with
    ``decoder_sparse_step=1``. Raises ``ValueError`` (one line) for what Qwen3-MoE cannot express."""
    hf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp")}
    hf |= {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.layers,
        "layer_types": ["full_attention"] * config.layers,
        "attention_dropout": 0.0,
    }
    moe = config.moe
    if not moe.enabled:
        return hf
    bad = [
        name
        for name, flag in {"router=sigmoid": moe.router != "softmax", "shared experts": moe.shared_experts > 0}.items()
        if flag
    ]
    if bad:
        raise ValueError(
            f"Qwen3-MoE cannot express this model ({', '.join(bad)}); export needs a softmax router and no shared "
            "experts"
        )
    del hf["layer_types"], hf["max_window_layers"]
    return hf | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": config.ffn_hidden,
        "moe_intermediate_size": config.expert_ffn_hidden,
        "num_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(config.layers) if not moe.is_moe_layer(i)],
        "norm_topk_prob": moe.norm_topk_prob,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": moe.aux_loss_coef > 0,
    }


def qwen_expert_name(logical: str) -> str:
    """Qwen3-MoE's key of an expert tensor: ``layers.0.mlp.experts.5.w1.weight`` -> ``...5.gate_proj.weight``."""
    head, ours, tail = logical.rsplit(".", 2)
    return f"{head}.{EXPERT_NAMES[ours]}.{tail}"
