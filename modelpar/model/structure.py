"""How one transformer layer is put together, as data: ``model.block`` (``BlockStructure``).

Llama's block is the default: ``x + attn(norm(x))``, ``x + mlp(norm(x))``, an RMSNorm scaled by ``weight``, a
SwiGLU MLP, scores scaled by ``1/sqrt(d)``. The other families people pretrain differ only in the fields below,
which ``modelpar.model.transformer.Block`` and the layers read; a new family is a config and an HF mapping,
not a new block class::

    norm        pre       x + attn(norm(x))                    Llama, Qwen3, Mistral
                post      x + norm(attn(x))                    OLMo 2
                sandwich  x + norm_out(attn(norm_in(x)))       Gemma 2/3
    norm_offset 0: y = x/rms(x) * w; 1: y = x/rms(x) * (1 + w) (Gemma; weights start at 0)
    activation  swiglu: silu(gate) * up; geglu: gelu_tanh(gate) * up (Gemma)
    embedding_scale  the embedding's output times sqrt(hidden), in the embedding's dtype (Gemma)
    query_scale      scores scaled by 1/sqrt(query_scale) (Gemma's query_pre_attn_scalar); 0: 1/sqrt(d)
    attention_softcap  scores s -> cap * tanh(s / cap) before the softmax (Gemma 2); 0: off
    final_softcap      logits z -> cap * tanh(z / cap) before the loss (Gemma 2); 0: off
    attention_sinks  one learned logit per head in each softmax's denominator (GPT-OSS's ``sinks``)
    qk_norm_scope    head: one RMSNorm over each head's d (Qwen3, Gemma 3); projection: one over all heads'
                     concatenation, weights [heads*d] (OLMo 2), its sum of squares reduced over tp
    local_rope_theta the sliding-window layers' own RoPE base, unscaled (Gemma 3's local layers; the global ones
                     keep rope_theta and rope_scaling); 0: every layer rope_theta and rope_scaling

The names of the norms follow the families that use each placement (HF's): ``NORM_NAMES``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from modelpar.model.rope import RopeScaling
from modelpar.parallel.layout import LayoutError


class ModelConfigError(ValueError):
    """A model shape that cannot exist; the message is one line naming the field and a fix."""


NORM_PLACEMENTS = ("pre", "post", "sandwich")
ACTIVATIONS = ("swiglu", "geglu")
QK_NORM_SCOPES = ("head", "projection")

# placement -> sub-layer -> (norm before it, norm after it), by the logical (HF) name of each norm
NORM_NAMES: dict[str, dict[str, tuple[str | None, str | None]]] = {
    "pre": {"attention": ("input_layernorm", None), "mlp": ("post_attention_layernorm", None)},
    "post": {"attention": (None, "post_attention_layernorm"), "mlp": (None, "post_feedforward_layernorm")},
    "sandwich": {
        "attention": ("input_layernorm", "post_attention_layernorm"),
        "mlp": ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    },
}


@dataclass
class BlockStructure:
    """The layer's structure (module docstring); the defaults are Llama's."""

    norm: str = "pre"
    norm_offset: float = 0.0
    activation: str = "swiglu"
    embedding_scale: bool = False
    query_scale: float = 0.0
    attention_softcap: float = 0.0
    final_softcap: float = 0.0
    attention_sinks: bool = False
    qk_norm_scope: str = "head"
    local_rope_theta: float = 0.0

    def check(self) -> None:
        for name, allowed in (
            ("norm", NORM_PLACEMENTS),
            ("activation", ACTIVATIONS),
            ("qk_norm_scope", QK_NORM_SCOPES),
        ):
            if getattr(self, name) not in allowed:
                raise ModelConfigError(f"model.block.{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.norm_offset not in (0.0, 1.0):
            raise ModelConfigError(
                f"model.block.norm_offset={self.norm_offset} must be 0 (scale = weight) or 1 (scale = 1 + weight)"
            )
        for name in ("query_scale", "attention_softcap", "final_softcap", "local_rope_theta"):
            if getattr(self, name) < 0:
                raise ModelConfigError(f"model.block.{name}={getattr(self, name)} must be >= 0 (0: off)")

    def check_with(self, model) -> None:
        """``check``, and the features of ``model`` (its ``ModelConfig``) this structure does not combine with."""
        self.check()
        b, m, changed = self, model, self.changed()
        if changed and (m.mla.enabled or m.mtp_depth):
            what = "model.mla (latent attention)" if m.mla.enabled else f"model.mtp_depth={m.mtp_depth}"
            raise ModelConfigError(
                f"{what} is DeepSeek-V3's Llama-style block; model.block.{next(iter(changed))} is not implemented "
                "with it: leave model.block at its defaults"
            )
        if b.activation != "swiglu" and m.moe.enabled:
            raise ModelConfigError(
                f"model.block.activation={b.activation} is for the dense MLP (the experts are SwiGLUs); set "
                "model.block.activation=swiglu or model.moe.experts=0"
            )
        if b.qk_norm_scope != "head" and not m.qk_norm:
            raise ModelConfigError(
                f"model.block.qk_norm_scope={b.qk_norm_scope} needs model.qk_norm=true; set it or the scope to head"
            )
        if b.local_rope_theta and not m.sliding_window:
            raise ModelConfigError(
                f"model.block.local_rope_theta={b.local_rope_theta} is the sliding-window layers' RoPE base; set "
                "model.sliding_window > 0 or local_rope_theta=0"
            )
        if m.fp8 != "off" and (b.norm != "pre" or b.activation != "swiglu"):
            raise ModelConfigError(
                f"model.fp8={m.fp8} is proven on the Llama block only; set model.fp8=off or model.block to defaults"
            )

    def check_layout_with(self, model, layout) -> None:
        """Raise ``LayoutError`` (one line) if ``layout`` cannot shard ``model`` (its ``ModelConfig``) with this
        structure."""
        if model.qk_norm and self.qk_norm_scope == "projection" and model.kv_heads % layout.tp:
            raise LayoutError(
                f"model.block.qk_norm_scope=projection with tp={layout.tp} not dividing model.kv_heads="
                f"{model.kv_heads}: replicated k heads would count twice in k's norm; use tp dividing kv_heads"
            )

    def rope(self, model, layer: int) -> tuple[float, RopeScaling]:
        """RoPE's base and scaling in block ``layer`` of ``model``: ``local_rope_theta``, unscaled, in a
        sliding-window layer if it is set; else the model's."""
        if self.local_rope_theta and model.window(layer):
            return self.local_rope_theta, RopeScaling()
        return model.rope_theta, model.rope_scaling

    def changed(self) -> dict:
        """The fields that differ from Llama's block (what a checkpoint's identity records)."""
        default = BlockStructure()
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) != getattr(default, f.name)}

    def norms(self, part: str) -> tuple[str | None, str | None]:
        """The names of the norms before and after sub-layer ``part`` (``attention`` or ``mlp``); None: none."""
        return NORM_NAMES[self.norm][part]

    def unfused(self) -> list[str]:
        """The pieces the fused Triton kernels do not implement, each run on its torch path instead (named in a
        run's banner)."""
        return [
            name
            for name, on in (
                ("GeGLU (the fused MLP kernel is SwiGLU)", self.activation == "geglu"),
                ("attention soft-cap (the flash kernel has none)", self.attention_softcap > 0),
                ("attention sinks (the flash kernel has none)", self.attention_sinks),
            )
            if on
        ]
