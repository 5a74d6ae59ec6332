"""The model's shape: the one type that says what a model is, for the recipe, the layers, FLOP counts and HF.

``ModelConfig`` is the recipe's ``model`` group (Hydra builds it from ``recipes/model/*.yaml``), what
``build_model`` takes, what ``modelpar.model.hf`` reads from a Hugging Face config, and what the planner and
the FLOP counts work from. Parallelism lives in the layout, never here.

A model's identity is the fields that change what its weights mean (``IDENTITY``): two configs that agree on
them load each other's checkpoints. ``name``, ``kernels`` (how it runs), ``compile``, ``init_std`` (only the
first draw) and ``max_seq_len`` (as long as the run's sequence fits) do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar_kernels import BACKENDS

IDENTITY = (
    "vocab_size",
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
)


class ModelConfigError(ValueError):
    """A model shape that cannot exist; the message is one line naming the field and a fix."""


@dataclass
class ModelConfig:
    """A Llama-style decoder: ``layers`` blocks of GQA attention (``heads`` query heads sharing ``kv_heads``
    key/value heads, RoPE) and a SwiGLU MLP of width ``ffn_hidden``, over a ``vocab_size`` embedding."""

    name: str = "custom"
    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    ffn_hidden: int = 176
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    kernels: str = "auto"  # auto | triton | torch: how the model runs, not what it is
    compile: bool = False  # each block under torch.compile

    def check(self) -> None:
        """Raise ``ModelConfigError`` (one line) if no model has this shape. Called by the recipe's ``validate``
        and by every model chunk built; a config itself is plain data (Hydra fills it field by field)."""
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.heads:
            raise ModelConfigError(
                f"model.hidden={self.hidden} is not a multiple of heads={self.heads}; change hidden or heads"
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"head dim hidden/heads={self.head_dim} must be even for RoPE; change model.hidden or model.heads"
            )
        if self.heads % self.kv_heads:
            raise ModelConfigError(
                f"model.kv_heads={self.kv_heads} must divide heads={self.heads}; try kv_heads in "
                f"{[k for k in range(1, self.heads + 1) if self.heads % k == 0]}"
            )
        if self.kernels not in BACKENDS:
            raise ModelConfigError(f"model.kernels={self.kernels!r} is not one of {BACKENDS}")

    def check_layout(self, layout) -> None:
        """Raise ``LayoutError`` (one line, with a fix) if ``layout`` (a ``ParallelLayout``) cannot shard this model."""
        layout.check_model(layers=self.layers, heads=self.heads, kv_heads=self.kv_heads, ffn_hidden=self.ffn_hidden)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def identity(self) -> dict:
        """The fields that define what the weights mean (see the module docstring)."""
        return {name: getattr(self, name) for name in IDENTITY}

    # -- parameter counts (matmul weights; norms are negligible) ------------------------------------------

    def attention_params(self) -> int:
        """Matmul weights of a block's attention half: the q, k, v and o projections."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def mlp_params(self) -> int:
        """Matmul weights of a block's MLP half: gate, up and down of the SwiGLU."""
        return 3 * self.hidden * self.ffn_hidden

    def block_params(self) -> int:
        """Matmul weights of one block: q, k, v, o projections and the gate/up/down SwiGLU."""
        return self.attention_params() + self.mlp_params()

    def matmul_params(self) -> int:
        return self.layers * self.block_params() + self.vocab_size * self.hidden
