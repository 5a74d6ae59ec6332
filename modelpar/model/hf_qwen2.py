"""Hugging Face Qwen2 / Qwen2.5 configs: ``Qwen2ForCausalLM`` <-> ``ModelConfig``.

Qwen2 is a Llama whose q, k and v projections carry biases (``model.attention_bias``; its o_proj has none, and
no ``attention_bias`` field says so: the biases are always there) and no QK-norm. Its sliding window is on only
with ``use_sliding_window``: then the layers ``layer_types`` names ``sliding_attention`` (when the file has no
``layer_types``, those from ``max_window_layers`` on, as transformers derives them) see the ``sliding_window``
latest positions (ours: ``sliding_window``, ``window_layers``). Every other field transformers reads is read as
for Llama (``modelpar.model.hf``); tensors carry Llama's names, the biases ``...q_proj.bias`` and so on.
"""

from __future__ import annotations

from modelpar.model.config import ModelConfig

QWEN2_TYPES = ("qwen2",)


def qwen2_unsupported(hf: dict) -> dict[str, bool]:
    """The Qwen2 features this model does not implement, by config field (true: present in ``hf``)."""
    return {"attention_dropout": bool(hf.get("attention_dropout", 0.0))}


def qwen2_fields(hf: dict, path) -> dict:
    """The sliding window fields of a ``qwen2`` config (none when it has no window)."""
    fields: dict = {}
    window, layers = hf.get("sliding_window"), hf["num_hidden_layers"]
    if not hf.get("use_sliding_window") or window is None:
        return fields
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{path}: sliding_window={window!r} must be a positive integer or null")
    first = hf.get("max_window_layers", layers)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise ValueError(f"{path}: layer_types={types} must give sliding_attention or full_attention per layer")
    local = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if not local:
        return fields
    return fields | {"sliding_window": window, "window_layers": [] if len(local) == layers else local}


def qwen2_config_to_hf(config: ModelConfig, llama: dict) -> dict:
    """``config.json`` of ``Qwen2ForCausalLM`` from the Llama fields ``llama`` (``config_to_hf``'s for the model
    without biases or window); the windowed layers are written as ``layer_types`` (and ``max_window_layers``,
    the first of them)."""
    hf = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    local = [i for i in range(config.layers) if config.window(i)]
    return hf | {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": bool(local),
        "sliding_window": config.sliding_window or None,
        "max_window_layers": local[0] if local else config.layers,
        "layer_types": ["sliding_attention" if config.window(i) else "full_attention" for i in range(config.layers)],
        "attention_dropout": 0.0,
    }


__all__ = ["QWEN2_TYPES", "qwen2_config_to_hf", "qwen2_fields", "qwen2_unsupported"]
