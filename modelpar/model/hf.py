"""Hugging Face Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 interoperability: import a
``LlamaForCausalLM``, ``MistralForCausalLM``, ``MixtralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM`` or ``DeepseekV3ForCausalLM`` directory into a model chunk at any tp (and ep), and export
one back to a directory that transformers loads (Qwen2's configs: ``modelpar.model.hf_qwen2``; Qwen3's:
``modelpar.model.hf_qwen``; DeepSeek-V3's configs, names and RoPE row order: ``modelpar.model.hf_deepseek``).
Mistral is Llama with a ``sliding_window`` (ours: every layer's window); a config's ``layer_types``
(``sliding_attention`` / ``full_attention`` per layer) gives ``window_layers``.

Only ``config.json`` and the weights (``model.safetensors``, or the shards its index names:
``modelpar.model.hf_files``) are read (safetensors, never pickle); each rank reads just the slices it holds.
Our logical names are HF's without the ``model.`` prefix (``lm_head.weight`` keeps its name), and HF's q/k
projections already use the rotate-half RoPE layout of our kernels, so no permutation is needed.
A Mixtral's MoE tensors are ``layers.<i>.mlp.gate.weight`` and ``layers.<i>.mlp.experts.<e>.w1|w2|w3.weight``
for us and ``model.layers.<i>.block_sparse_moe....`` in its safetensors file; a Qwen3-MoE's experts are
``model.layers.<i>.mlp.experts.<e>.gate_proj|up_proj|down_proj.weight`` (what transformers 5.x's
``save_pretrained`` writes, one tensor per expert). A file holding the experts fused as transformers keeps them
in memory (``mlp.experts.gate_up_proj`` [E, 2f, h], gate rows first, and ``mlp.experts.down_proj`` [E, h, f])
is read too.

OLMo 2 (``Olmo2ForCausalLM``: ``modelpar.model.hf_olmo``), Gemma 3 text and Gemma 2 (``Gemma3ForCausalLM``,
``Gemma2ForCausalLM``: ``modelpar.model.hf_gemma``) are named as Llama; what sets them apart is their configs'
block structure.

Which family a model exports as: a latent-attention model as DeepSeek-V3, a post-norm block as OLMo 2, a
sandwich block as Gemma 3 (Gemma 2 without QK-norm), a QK-norm model as Qwen3 (Qwen3-MoE with experts), one
with q/k/v biases but none on o_proj as Qwen2, any other as Llama (Mixtral with experts).
A Llama's or Qwen3's ``attention_bias`` puts biases on q, k, v and o_proj (ours: ``attention_bias`` and
``attention_out_bias``); Mistral and Mixtral have none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from modelpar.model.config import MLAConfig, ModelConfig, MoEConfig
from modelpar.model.hf_deepseek import (
    DEEPSEEK_TYPES,
    deepseek_config_from_hf,
    deepseek_config_to_hf,
    deepseek_name,
    rope_head_dim,
    rope_rows_from_hf,
    rope_rows_to_hf,
)
from modelpar.model.hf_files import DEFAULT_MAX_SHARD, HFWeights, write_hf_weights
from modelpar.model.hf_gemma import GEMMA_TYPES, gemma_config_to_hf, gemma_fields, gemma_unsupported
from modelpar.model.hf_gpt_oss import (
    GPT_OSS_TYPES,
    expert_from_fused,
    expert_part,
    fuse_experts,
    fused_key,
    gpt_oss_config_to_hf,
    gpt_oss_fields,
    gpt_oss_name,
    gpt_oss_unsupported,
)
from modelpar.model.hf_olmo import OLMO_TYPES, olmo_config_to_hf, olmo_fields, olmo_unsupported
from modelpar.model.hf_qwen import QWEN_TYPES, qwen_config_to_hf, qwen_expert_name, qwen_moe_config, qwen_unsupported
from modelpar.model.hf_qwen2 import QWEN2_TYPES, qwen2_config_to_hf, qwen2_fields, qwen2_unsupported
from modelpar.model.hf_rope import rope_parameters_of, rope_scaling_from_hf, rope_scaling_to_hf
from modelpar.model.mxfp4 import SUFFIXES as MXFP4_SUFFIXES
from modelpar.model.mxfp4 import mxfp4_expert
from modelpar.model.structure import BlockStructure
from modelpar.model.transformer import ModelChunk

FAMILY_NAMES = {
    "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "olmo2": "OLMo 2", "gemma3_text": "Gemma 3",
    "gemma2": "Gemma 2", "gpt_oss": "GPT-OSS",
}  # fmt: skip
CONFIG_NAME = "config.json"


def hf_name(logical: str, model_type: str = "llama", layers: int = 0) -> str:
    """HF state-dict key of a logical tensor: ``layers.0.mlp.up_proj.weight`` -> ``model.layers.0...``; a
    Mixtral router or expert ``layers.0.mlp.experts.5.w1.weight`` -> ``model.layers.0.block_sparse_moe...``, a
    Qwen3-MoE or DeepSeek-V3 expert -> ``model.layers.0.mlp.experts.5.gate_proj.weight`` (a DeepSeek-V3 MTP
    module's tensors after the model's ``layers``: ``modelpar.model.hf_deepseek.deepseek_name``)."""
    if model_type in DEEPSEEK_TYPES:
        return deepseek_name(logical, layers)
    if logical == "lm_head.weight":
        return logical
    if model_type in GPT_OSS_TYPES and gpt_oss_name(logical):
        return gpt_oss_name(logical)
    if model_type == "mixtral":
        for moe_part in (".mlp.gate.", ".mlp.experts."):
            logical = logical.replace(moe_part, moe_part.replace(".mlp.", ".block_sparse_moe."))
    elif model_type == "qwen3_moe" and ".mlp.experts." in logical:
        logical = qwen_expert_name(logical)
    return f"model.{logical}"


def fused_expert(logical: str) -> tuple[str, int, str] | None:
    """Where an expert tensor sits among fused experts: (HF key, expert, ``gate`` | ``up`` | ``down``), or None
    for a tensor that is not an expert's."""
    head, sep, tail = logical.partition(".mlp.experts.")
    if not sep:
        return None
    expert, ours, _ = tail.split(".")
    part = {"w1": "gate", "w3": "up", "w2": "down"}[ours]
    return f"model.{head}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}", int(expert), part


def config_from_hf(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` of a Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE or DeepSeek-V3 checkpoint;
    refuse, in one line naming the fields, features this model does not implement."""
    hf = json.loads((Path(path) / CONFIG_NAME).read_text())
    kind = hf.get("model_type")
    known = ("llama", "mistral", "mixtral", *QWEN2_TYPES, *QWEN_TYPES, *DEEPSEEK_TYPES, *OLMO_TYPES, *GEMMA_TYPES,
             *GPT_OSS_TYPES)  # fmt: skip
    if kind not in known:
        raise ValueError(f"{path}: model_type={kind!r}; supported: {', '.join(repr(k) for k in known)}")
    if kind in DEEPSEEK_TYPES:
        return deepseek_config_from_hf(hf, path)
    heads = hf["num_attention_heads"]
    rope = rope_parameters_of(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    biased = kind in ("llama", *QWEN_TYPES) and bool(hf.get("attention_bias", False))  # q, k, v and o_proj
    unsupported = {
        "attention_bias": kind in ("mistral", "mixtral") and bool(hf.get("attention_bias", False)),
        "mlp_bias": hf.get("mlp_bias", False),
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
    }
    moe = MoEConfig()
    if kind == "mixtral":
        unsupported |= {"router_jitter_noise": bool(hf.get("router_jitter_noise", 0.0))}
        moe = MoEConfig(
            experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            ffn_hidden=hf["intermediate_size"],
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0,
        )
    if kind in QWEN_TYPES:
        unsupported |= qwen_unsupported(hf)
    if kind in QWEN2_TYPES:
        unsupported |= qwen2_unsupported(hf)
    if kind in OLMO_TYPES:
        unsupported |= olmo_unsupported(hf)
    if kind in GEMMA_TYPES:
        unsupported |= gemma_unsupported(hf)  # its RoPE per layer type, not at the top level
    if kind in GPT_OSS_TYPES:
        unsupported |= gpt_oss_unsupported(hf)
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        family = FAMILY_NAMES.get(kind, kind.capitalize())
        raise ValueError(f"{path}: unsupported {family} variant ({', '.join(bad)}); modelpar implements plain {family}")
    if kind == "qwen3_moe":
        moe = qwen_moe_config(hf, hf["num_hidden_layers"])
    fields = dict(
        vocab_size=hf["vocab_size"],
        hidden=hf["hidden_size"],
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling_from_hf(hf, path),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        head_dim=0 if head_dim == hf["hidden_size"] // heads else head_dim,
        qk_norm=kind in QWEN_TYPES,
        attention_bias=biased or kind in QWEN2_TYPES,  # Qwen2's q, k and v always have biases
        attention_out_bias=biased,
        init_std=hf.get("initializer_range", 0.02),
        moe=moe,
        **(qwen2_fields(hf, path) if kind in QWEN2_TYPES else _window_from_hf(hf, path)),
    )
    if kind in OLMO_TYPES:
        fields |= olmo_fields(hf)
    if kind in GEMMA_TYPES:
        fields |= gemma_fields(hf, _window_from_hf(hf, path), path)
    if kind in GPT_OSS_TYPES:
        fields |= gpt_oss_fields(hf)
    return ModelConfig(**fields)


def _window_from_hf(hf: dict, path) -> dict:
    """``sliding_window`` and ``window_layers`` of a Mistral/Mixtral config (a Llama has neither; Qwen3's
    ``use_sliding_window`` is refused by ``modelpar.model.hf_qwen``)."""
    windowed = ("mistral", "mixtral", *GEMMA_TYPES, *GPT_OSS_TYPES)
    window = hf.get("sliding_window") if hf.get("model_type") in windowed else None
    if window is None:
        return {}
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{path}: sliding_window={window!r} must be a positive integer or null")
    types = hf.get("layer_types")
    if types is None or all(t == "sliding_attention" for t in types):
        return {"sliding_window": window}
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != hf["num_hidden_layers"]:
        raise ValueError(f"{path}: layer_types={types} must give sliding_attention or full_attention per layer")
    local = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return {"sliding_window": window, "window_layers": local} if local else {}


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` contents for ``LlamaForCausalLM``, ``MistralForCausalLM`` for a sliding window, or
    ``MixtralForCausalLM`` for a mixture of experts that Mixtral can express; a QK-norm model's for
    ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM``; a latent-attention model's for ``DeepseekV3ForCausalLM``.
    Raises ``ValueError`` (one line) for a model the family cannot express."""
    if config.mla.enabled:
        llama = config_to_hf(_plain(config, mla=MLAConfig(), moe=MoEConfig(), mtp_depth=0), dtype)
        return deepseek_config_to_hf(config, llama)
    if config.block.attention_sinks or config.moe.activation == "clamped_swiglu":
        plain = dict(block=BlockStructure(), moe=MoEConfig(), sliding_window=0, window_layers=[])
        return gpt_oss_config_to_hf(config, config_to_hf(_plain(config, **plain), dtype))
    if config.block.norm != "pre":  # OLMo 2's post-norms, Gemma's sandwich
        plain = _plain(config, block=BlockStructure(), qk_norm=False, sliding_window=0, window_layers=[])
        to_hf = olmo_config_to_hf if config.block.norm == "post" else gemma_config_to_hf
        return to_hf(config, config_to_hf(plain, dtype))
    if config.mtp_depth:
        raise ValueError(
            f"model.mtp_depth={config.mtp_depth}: only DeepSeek-V3 (latent attention, model.mla) checkpoints hold "
            "multi-token prediction modules; set model.mtp_depth=0 to export without them"
        )
    if config.attention_bias != config.attention_out_bias:
        return _qwen2_config(config, dtype)
    if config.attention_bias and not config.qk_norm and (config.moe.enabled or config.sliding_window):
        raise ValueError(
            "Mixtral and Mistral have no attention biases; a model with experts or a sliding window cannot be "
            "exported with model.attention_bias / attention_out_bias: set both false"
        )
    if config.sliding_window and config.window_layers:
        raise ValueError(
            f"Mistral and Mixtral give every layer the window; model.window_layers={list(config.window_layers)} "
            "(local and global layers) cannot be exported: set model.window_layers=[]"
        )
    if config.qk_norm:
        if config.sliding_window:
            raise ValueError(
                f"a QK-norm model exports as Qwen3, which modelpar writes without a window; "
                f"model.sliding_window={config.sliding_window} cannot be exported: set model.sliding_window=0"
            )
        return qwen_config_to_hf(config, config_to_hf(_plain(config, qk_norm=False, moe=MoEConfig()), dtype))
    if config.moe.enabled:
        return _mixtral_config(config, dtype)
    if config.sliding_window:
        plain = config_to_hf(_plain(config, sliding_window=0), dtype)
        return plain | {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "sliding_window": config.sliding_window,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "intermediate_size": config.ffn_hidden,
        "max_position_embeddings": config.max_seq_len,
        "rope_parameters": rope_scaling_to_hf(config.rope_scaling, config.rope_theta),
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "hidden_act": "silu",
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        # no padding_idx: transformers gives that embedding row no gradient (Gemma's default pad is token 0, OLMo
        # 2's token 1), so training the export there would freeze a row modelpar trains
        "pad_token_id": None,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _qwen2_config(config: ModelConfig, dtype: torch.dtype) -> dict:
    """Biases on q, k and v only: Qwen2, the one family that has them so; refused (one line) otherwise."""
    unsupported = {
        "model.attention_out_bias without model.attention_bias": config.attention_out_bias,
        "QK-norm": config.qk_norm,
        "experts": config.moe.enabled,
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(
            f"q/k/v biases without an o_proj bias export as Qwen2, which cannot express this model ({', '.join(bad)}); "
            "set model.attention_out_bias equal to model.attention_bias for a Llama or Qwen3"
        )
    plain = _plain(config, attention_bias=False, sliding_window=0, window_layers=[])
    return qwen2_config_to_hf(config, config_to_hf(plain, dtype))


def _mixtral_config(config: ModelConfig, dtype: torch.dtype) -> dict:
    moe = config.moe
    every_layer = all(moe.is_moe_layer(i) for i in range(config.layers))
    unsupported = {
        "MoE in only some layers": not every_layer,
        f"router={moe.router}": moe.router != "softmax",
        "shared experts": moe.shared_experts > 0,
        f"n_group={moe.n_group}": moe.n_group > 1,
        f"routed_scaling_factor={moe.routed_scaling_factor}": moe.routed_scaling_factor != 1.0,
        "norm_topk_prob=false": not moe.norm_topk_prob,
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(
            f"Mixtral cannot express this model ({', '.join(bad)}); export needs a softmax router in every "
            "layer, no shared experts and Mixtral's top-k weights (no groups, renormalised, unscaled)"
        )
    hf = config_to_hf(_plain(config, moe=MoEConfig(), sliding_window=0), dtype)
    del hf["mlp_bias"]
    return hf | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": config.expert_ffn_hidden,
        "num_local_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": moe.aux_loss_coef > 0,
        "router_jitter_noise": 0.0,
        "sliding_window": config.sliding_window or None,
    }


def _plain(config: ModelConfig, **fields) -> ModelConfig:
    return ModelConfig(**{**config.__dict__, **fields})


@dataclass(frozen=True)
class HFSource:
    """Where a logical tensor's value lies in a Hugging Face directory: the whole of tensor ``key``, or rows
    ``rows`` of expert ``expert`` of fused experts ``key``; ``interleaved``: a DeepSeek-V3 tensor whose RoPE rows
    are reordered (whole heads) to rotate-half."""

    key: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    interleaved: bool = False
    fused_part: str | None = None  # GPT-OSS: our ``w1.weight`` ... of expert ``expert`` (``hf_gpt_oss``)
    mxfp4: bool = False  # GPT-OSS's released experts: ``key``_blocks and ``key``_scales, dequantised on read

    def read_fused(self, weights: HFWeights) -> torch.Tensor:
        """Expert ``expert``'s slice of GPT-OSS's fused tensor ``key`` (dequantised from MXFP4 if stored so)."""
        e = self.expert
        if not self.mxfp4:
            return weights.get_slice(self.key)[e : e + 1][0]
        blocks, scales = (weights.get_slice(self.key + suffix)[e : e + 1][0] for suffix in MXFP4_SUFFIXES)
        return mxfp4_expert(blocks, scales)


def hf_source(name: str, weights: HFWeights, hf: dict, config: ModelConfig) -> HFSource:
    """Where logical tensor ``name`` of ``config`` is among ``weights`` (named as ``hf``, the directory's
    ``config.json``, names them; experts one tensor each or fused)."""
    kind = hf.get("model_type", "llama")
    part = expert_part(name) if kind in GPT_OSS_TYPES else None
    if part is not None:  # one expert's slice of GPT-OSS's fused, interleaved, transposed tensors
        prefix, expert, ours = part
        key = prefix + fused_key(ours)
        quantised = key not in weights and all(key + suffix in weights for suffix in MXFP4_SUFFIXES)
        return HFSource(key, expert, fused_part=ours, mxfp4=quantised)
    key = hf_name(name, kind, config.layers)
    interleaved = kind in DEEPSEEK_TYPES and hf.get("rope_interleave", True)
    if interleaved and key in weights and rope_head_dim(name, config.mla):
        return HFSource(key, interleaved=True)
    for candidate in (key, hf_name(name)):  # a fused Mixtral's router is under mlp., not block_sparse_moe.
        if candidate in weights:
            return HFSource(candidate)
    fused = fused_expert(name)
    if fused is None or fused[0] not in weights:
        raise KeyError(f"{weights.path}: {key} is missing from its weight files")
    key, expert, part = fused
    rows = weights.reader(key).shape(key)[1] // (1 if part == "down" else 2)
    start = rows if part == "up" else 0
    return HFSource(key, expert, (start, start + rows))


def hf_value(weights: HFWeights, src: HFSource, name: str, config: ModelConfig, index: tuple = ()) -> torch.Tensor:
    """``value[index]`` of logical tensor ``name`` found at ``src``, reading only those rows where the file
    allows (a DeepSeek-V3 RoPE tensor is read whole: its heads are reordered first)."""
    if src.interleaved:
        return rope_rows_from_hf(name, weights.get_tensor(src.key), config.mla)[index]
    if src.fused_part is not None:
        return expert_from_fused(src.read_fused(weights), src.fused_part)[index]
    if src.expert is None:
        return weights.get_slice(src.key)[index] if index else weights.get_tensor(src.key)
    (start, stop), e = src.rows, src.expert
    return weights.get_slice(src.key)[e : e + 1, start:stop][0][index]


def import_hf(path: str | os.PathLike, chunk: ModelChunk) -> None:
    """Load this rank's slices of every logical tensor of ``chunk`` from ``path``'s weights (named as
    ``path/config.json``'s ``model_type`` names them; experts one tensor each or fused; a DeepSeek-V3's
    interleaved RoPE rows reordered to rotate-half)."""
    hf = json.loads((Path(path) / CONFIG_NAME).read_text())
    with HFWeights(path) as f:
        chunk.load_logical(
            lambda name, shard: hf_value(f, hf_source(name, f, hf, chunk.config), name, chunk.config, shard.index)
        )


def save_hf(
    path: str | os.PathLike,
    config: ModelConfig,
    state: Mapping[str, torch.Tensor],
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
) -> None:
    """Write ``config.json`` and the weights (``model.safetensors``, or shards of at most ``max_shard_size``
    with their index) from full logical tensors (all of the model's)."""
    path = Path(path)
    dtype = next(iter(state.values())).dtype
    hf_config = config_to_hf(config, dtype)  # a model HF cannot express is refused before anything is written
    path.mkdir(parents=True, exist_ok=True)
    kind = hf_config["model_type"]
    if kind in DEEPSEEK_TYPES:  # written with rope_interleave, V3's own row order
        state = {name: rope_rows_to_hf(name, t, config.mla) for name, t in state.items()}
    tensors = {hf_name(name, kind, config.layers): t.detach().cpu().contiguous() for name, t in state.items()}
    if kind in GPT_OSS_TYPES:  # the experts fused as GPT-OSS keeps them
        state = {name: t.detach().cpu() for name, t in state.items()}
        tensors = {k: t for k, t in tensors.items() if ".mlp.experts." not in k}
        tensors |= {k: t.contiguous() for k, t in fuse_experts(state, config.layers).items()}
    (path / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    entries = {key: (t.dtype, tuple(t.shape)) for key, t in tensors.items()}
    write_hf_weights(path, entries, tensors.__getitem__, max_shard_size)


def export_hf(chunk: ModelChunk, path: str | os.PathLike) -> None:
    """Gather ``chunk`` (the whole model, no pipeline) over tp (and its experts over ep) and write it on tp
    rank 0 of ep rank 0.

    Collective over the tp group; call it from one data-parallel replica (under expert parallelism, from
    every rank of the ep group, which spans replicas). With pipeline stages, merge each
    stage's ``chunk.full_state()`` and call ``save_hf``.
    """
    if not (chunk.first and chunk.last and len(chunk.layer_ids) == chunk.config.layers):
        raise ValueError("export_hf needs the whole model in one chunk; merge stages' full_state() and use save_hf")
    state = chunk.full_state()
    if chunk.tp.rank == 0 and chunk.ep.rank == 0:
        save_hf(path, chunk.config, state)
