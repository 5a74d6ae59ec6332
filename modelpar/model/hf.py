"""Hugging Face Llama interoperability: import a ``LlamaForCausalLM`` directory into a model chunk at any tp,
and export one back to a directory that ``transformers.LlamaForCausalLM.from_pretrained`` loads.

Only ``config.json`` and ``model.safetensors`` are read (safetensors, never pickle); each rank reads just the
slices it holds. Our logical names are HF's without the ``model.`` prefix (``lm_head.weight`` keeps its name),
and HF's q/k projections already use the rotate-half RoPE layout of our kernels, so no permutation is needed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modelpar.model.config import ModelConfig
from modelpar.model.transformer import ModelChunk

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def hf_name(logical: str) -> str:
    """HF state-dict key of a logical tensor: ``layers.0.mlp.up_proj.weight`` -> ``model.layers.0...``."""
    return logical if logical == "lm_head.weight" else f"model.{logical}"


def config_from_hf(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` of a Llama checkpoint; refuse features this model does not implement."""
    hf = json.loads((Path(path) / CONFIG_NAME).read_text())
    if hf.get("model_type") != "llama":
        raise ValueError(f"{path}: model_type={hf.get('model_type')!r}, only 'llama' is supported")
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    unsupported = {
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "head_dim": hf.get("head_dim", hf["hidden_size"] // heads) != hf["hidden_size"] // heads,
        "rope_type": rope.get("rope_type", rope.get("type", "default")) != "default",
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"{path}: unsupported Llama variant ({', '.join(bad)}); modelpar implements plain Llama")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden=hf["hidden_size"],
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
    )


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` contents for ``LlamaForCausalLM``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_hidden,
        "max_position_embeddings": config.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": str(dtype).removeprefix("torch."),
    }


def import_hf(path: str | os.PathLike, chunk: ModelChunk) -> None:
    """Load this rank's slices of every logical tensor of ``chunk`` from ``path/model.safetensors``."""
    with safe_open(Path(path) / WEIGHTS_NAME, framework="pt") as f:
        keys = set(f.keys())

        def fetch(name, shard):
            key = hf_name(name)
            if key not in keys:
                raise KeyError(f"{path}: {key} is missing from {WEIGHTS_NAME}")
            return f.get_slice(key)[shard.index]

        chunk.load_logical(fetch)


def save_hf(path: str | os.PathLike, config: ModelConfig, state: Mapping[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` from full logical tensors (all of the model's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state.values())).dtype
    tensors = {hf_name(name): t.detach().cpu().contiguous() for name, t in state.items()}
    save_file(tensors, path / WEIGHTS_NAME, metadata={"format": "pt"})
    (path / CONFIG_NAME).write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n")


def export_hf(chunk: ModelChunk, path: str | os.PathLike) -> None:
    """Gather ``chunk`` (the whole model, no pipeline) over tp and write it on tp rank 0.

    Collective over the tp group; call it from one data-parallel replica. With pipeline stages, merge each
    stage's ``chunk.full_state()`` and call ``save_hf``.
    """
    if not (chunk.first and chunk.last and len(chunk.layer_ids) == chunk.config.layers):
        raise ValueError("export_hf needs the whole model in one chunk; merge stages' full_state() and use save_hf")
    state = chunk.full_state()
    if chunk.tp.rank == 0:
        save_hf(path, chunk.config, state)
