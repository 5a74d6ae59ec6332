"""Hugging Face GPT-OSS: ``GptOssForCausalLM`` (``model_type`` gpt_oss) <-> ``ModelConfig`` and its fused experts.

GPT-OSS is a pre-norm block whose attention has sinks (``model.block.attention_sinks``), q/k/v/o biases
(``attention_bias``, ``attention_out_bias``), alternating sliding-window and full layers (``layer_types``) and
YaRN (``rope_parameters``, ``modelpar.model.hf_rope``); every layer's MLP is a mixture of experts whose router
and experts have biases (``model.moe.bias``) and whose gated activation is clamped
(``model.moe.activation=clamped_swiglu``, ``swiglu_alpha``, ``swiglu_limit``). transformers routes with a
softmax over the top-k logits, which is our softmax router with its top-k weights renormalised.

Tensors: the router is ``mlp.router.weight|bias`` (ours ``mlp.gate.*``); the experts are fused,
``mlp.experts.gate_up_proj`` [E, h, 2f] with gate and up *interleaved* along the last dim (gate the even
columns, up the odd), ``gate_up_proj_bias`` [E, 2f] likewise, ``down_proj`` [E, f, h] and ``down_proj_bias``
[E, h]: stored as x @ W, the transpose of ours (``w1``, ``w3`` [f, h], ``w2`` [h, f]). The released checkpoints
hold MXFP4-quantised experts (``quantization_config.quant_method`` mxfp4: ``gate_up_proj_blocks`` and
``_scales`` ...), dequantised on import one expert at a time (``modelpar.model.mxfp4``); another quantisation
method is refused. Export writes the experts unquantised (no ``quantization_config``).
"""

from __future__ import annotations

import torch

from modelpar.model.config import MoEConfig
from modelpar.model.structure import BlockStructure

GPT_OSS_TYPES = ("gpt_oss",)
# ours -> (fused HF tensor, columns of the interleaved last dim or None, transposed)
_EXPERT_PARTS = {
    "w1.weight": ("gate_up_proj", 0, True),
    "w3.weight": ("gate_up_proj", 1, True),
    "w2.weight": ("down_proj", None, True),
    "w1.bias": ("gate_up_proj_bias", 0, False),
    "w3.bias": ("gate_up_proj_bias", 1, False),
    "w2.bias": ("down_proj_bias", None, False),
}


def gpt_oss_unsupported(hf: dict) -> dict[str, bool]:
    """The GPT-OSS features this model does not implement, by config field (true: present in ``hf``)."""
    return {
        # MXFP4 experts are dequantised on import; another method is not read
        "quantization_config": (hf.get("quantization_config") or {}).get("quant_method", "mxfp4") != "mxfp4",
        "attention_dropout": bool(hf.get("attention_dropout", 0.0)),
    }


def mxfp4_experts(hf: dict) -> bool:
    """Whether a GPT-OSS ``config.json`` says its experts are stored in MXFP4 (dequantised on import)."""
    return (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def gpt_oss_fields(hf: dict) -> dict:
    """The ``ModelConfig`` fields a ``gpt_oss`` config sets beyond Llama's (the window comes with them)."""
    biased = bool(hf.get("attention_bias", True))
    moe = MoEConfig(
        experts=hf["num_local_experts"],
        top_k=hf.get("num_experts_per_tok", hf.get("experts_per_token", 4)),
        ffn_hidden=hf["intermediate_size"],
        bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0,
    )
    return {
        "attention_bias": biased,
        "attention_out_bias": biased,
        "moe": moe,
        "block": BlockStructure(attention_sinks=True),
    }


def gpt_oss_name(logical: str) -> str | None:
    """GPT-OSS's key of a router tensor (``mlp.gate.*`` -> ``mlp.router.*``); None for any other."""
    if ".mlp.gate." in logical:
        return "model." + logical.replace(".mlp.gate.", ".mlp.router.")
    return None


def expert_part(logical: str) -> tuple[str, int, str] | None:
    """(layer prefix ``layers.<i>.mlp.experts.``, expert, our tensor ``w1.weight`` ...) of an expert tensor."""
    head, sep, tail = logical.partition(".mlp.experts.")
    if not sep:
        return None
    expert, ours = tail.split(".", 1)
    return f"model.{head}.mlp.experts.", int(expert), ours


def fused_key(ours: str) -> str:
    """The GPT-OSS tensor (after ``mlp.experts.``) holding our expert tensor ``ours`` (``w1.weight`` ...)."""
    return _EXPERT_PARTS[ours][0]


def fused_experts_of(names, layers: int) -> dict[str, list[str]]:
    """GPT-OSS key -> the logical tensors (``layers.<i>.mlp.experts.<e>.<ours>``) it fuses, experts in order."""
    out: dict[str, list[str]] = {}
    for name in names:
        part = expert_part(name)
        if part is not None:
            out.setdefault(part[0] + fused_key(part[2]), []).append(name)
    order = {key: sorted(group, key=lambda n: (expert_part(n)[2].startswith("w3"), expert_part(n)[1]))
             for key, group in out.items()}  # fmt: skip
    return order  # gate_up: every gate, then every up


def fused_value(key: str, values: list[torch.Tensor]) -> torch.Tensor:
    """GPT-OSS tensor ``key`` from the per-expert tensors it fuses (both gate and up for ``gate_up_proj*``:
    ``values`` = gates then ups, ``2E`` of them; else ``E``)."""
    if key.endswith(("gate_up_proj", "gate_up_proj_bias")):
        e = len(values) // 2
        gate, up = torch.stack(values[:e]), torch.stack(values[e:])
        if key.endswith("gate_up_proj"):
            gate, up = gate.transpose(1, 2), up.transpose(1, 2)  # [E, h, f]
        return torch.stack([gate, up], dim=-1).flatten(-2)  # gate even, up odd
    stacked = torch.stack(values)
    return stacked.transpose(1, 2) if key.endswith("down_proj") else stacked


def expert_from_fused(fused: torch.Tensor, ours: str) -> torch.Tensor:
    """One expert's tensor in our layout from its slice ``fused[e]`` of the GPT-OSS tensor ``_EXPERT_PARTS``
    names."""
    _, column, transposed = _EXPERT_PARTS[ours]
    value = fused if column is None else fused[..., column::2]
    return value.transpose(0, 1) if transposed else value


def fuse_experts(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """GPT-OSS's tensors of every expert of every layer from our per-expert logical tensors (the others left
    out): gate and up interleaved, transposed to x @ W."""
    return {
        key: fused_value(key, [state[name] for name in names]) for key, names in fused_experts_of(state, layers).items()
    }


def gpt_oss_config_to_hf(config, llama: dict) -> dict:
    """``config.json`` of ``GptOssForCausalLM`` from the Llama fields ``llama``. Raises ``ValueError`` (one
    line) for a model GPT-OSS cannot express."""
    moe, b = config.moe, config.block
    every = all(moe.is_moe_layer(i) for i in range(config.layers))
    bad = [
        name
        for name, on in (
            ("block." + next(iter(b.changed()), ""), set(b.changed()) != {"attention_sinks"}),
            ("moe.bias=false", not moe.bias),
            (f"moe.activation={moe.activation}", moe.activation != "clamped_swiglu"),
            ("MoE in only some layers", not every),
            (f"router={moe.router}", moe.router != "softmax"),
            ("shared experts", moe.shared_experts > 0),
            ("norm_topk_prob=false", not moe.norm_topk_prob),
            ("qk_norm", config.qk_norm),
            ("attention_bias differs from attention_out_bias", config.attention_bias != config.attention_out_bias),
        )
        if on
    ]
    if bad:
        raise ValueError(
            f"GPT-OSS cannot express this model ({', '.join(bad)}); export needs sinks, a biased softmax router "
            "and biased clamped-SwiGLU experts in every layer"
        )
    hf = {k: v for k, v in llama.items() if k not in ("mlp_bias", "head_dim")}
    return hf | {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "head_dim": config.head_size,
        "intermediate_size": config.expert_ffn_hidden,
        "num_local_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "swiglu_alpha": moe.swiglu_alpha,
        "swiglu_limit": moe.swiglu_limit,
        "attention_bias": config.attention_bias,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": moe.aux_loss_coef > 0,
        "sliding_window": config.sliding_window or None,
        "layer_types": ["sliding_attention" if config.window(i) else "full_attention" for i in range(config.layers)],
        "attention_dropout": 0.0,
    }
