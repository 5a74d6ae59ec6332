"""The model's shape: the one type that says what a model is, for the recipe, the layers, FLOP counts and HF.

``ModelConfig`` is the recipe's ``model`` group (Hydra builds it from ``recipes/model/*.yaml``), what
``build_model`` takes, what ``modelpar.model.hf`` reads from a Hugging Face config, and what the planner and
the FLOP counts work from. Parallelism lives in the layout, never here.

A model's identity is the fields that change what its weights mean (``IDENTITY``): two configs that agree on
them load each other's checkpoints. ``name``, ``kernels`` (how it runs), ``compile``, ``fp8`` (the GEMMs'
precision; the weights are the same fp32 masters), ``init_std`` (only the
first draw), ``max_seq_len`` (as long as the run's sequence fits) and the sliding window (``sliding_window``,
``window_layers``: which keys a query attends to, not what any weight means; a checkpoint trained with one
window loads with another or none, as Mistral-style checkpoints are evaluated at other windows, and checkpoints
written before the window existed load unchanged) do not. A mixture of experts adds its ``moe`` shape
(``MoEConfig.IDENTITY``) to the identity, multi-head latent attention its ``mla`` shape (``MLAConfig.IDENTITY``);
a dense GQA model's identity is unchanged by either, so its old checkpoints still load.
``head_dim`` and ``qk_norm`` are identity fields that a checkpoint written before they existed does not hold:
reading one, their defaults (hidden/heads, no QK-norm) are what its weights mean. So are the attention biases
(``attention_bias``, ``attention_out_bias``) and the RoPE scaling (``rope_scaling``, ``modelpar.model.rope``):
part of the identity only when on, so a model without them keeps the identity it had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelpar_kernels import BACKENDS

from modelpar.model.layers.fp8 import FP8_MODES
from modelpar.model.moe_config import MoEConfig
from modelpar.model.rope import RopeScaling, RopeScalingError
from modelpar.model.structure import BlockStructure, ModelConfigError
from modelpar.parallel.layout import LayoutError

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
    "head_dim",
    "qk_norm",
    "attention_bias",
    "attention_out_bias",
    "rope_scaling",
)
# identity fields that a model without them (their default) leaves out of ``identity()``
# (``rope_scaling``: its ``identity()``, when it is enabled)
OPTIONAL_IDENTITY = {"attention_bias": False, "attention_out_bias": False}


# What the model computes but not what its weights mean: a checkpoint's values are what evaluating it uses
# unless the run overrides them (``modelpar.cli.eval``), but another value may resume or fine-tune it.
ATTENTION_VARIANT = ("sliding_window", "window_layers")


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, ``modelpar.model.layers.latent_attention``) in place of GQA;
    ``kv_lora_rank=0``: off (plain GQA attention).

    Keys and values of every head are expanded from one per-token latent of ``kv_lora_rank`` (RMSNormed) by
    ``kv_b_proj``, into a ``qk_nope_head_dim`` key part and a ``v_head_dim`` value per head; the RoPE key part
    (``qk_rope_head_dim``) is one more per-token vector shared by every head. Queries go through a
    ``q_lora_rank`` latent (RMSNormed) when it is > 0, else straight through ``q_proj`` (DeepSeek-V2-Lite).
    The qk head dim is ``qk_nope_head_dim + qk_rope_head_dim``; scores are scaled by its inverse square root.
    """

    IDENTITY = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check(self) -> None:
        if self.kv_lora_rank < 0:
            raise ModelConfigError(f"model.mla.kv_lora_rank={self.kv_lora_rank} must be >= 0 (0: GQA attention)")
        if not self.enabled:
            others = [n for n in self.IDENTITY[1:] if getattr(self, n)]
            if others:
                raise ModelConfigError(
                    f"model.mla.{others[0]}={getattr(self, others[0])} needs latent attention; set "
                    "model.mla.kv_lora_rank > 0 or leave it 0"
                )
            return
        if self.q_lora_rank < 0:
            raise ModelConfigError(f"model.mla.q_lora_rank={self.q_lora_rank} must be >= 0 (0: q_proj directly)")
        for name in ("qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"model.mla.{name}={getattr(self, name)} must be >= 1")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ModelConfigError(
                f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even and >= 2 (RoPE rotates pairs)"
            )

    def identity(self) -> dict:
        return {name: getattr(self, name) for name in self.IDENTITY}


@dataclass
class ModelConfig:
    """A Llama-style decoder: ``layers`` blocks of GQA attention (``heads`` query heads sharing ``kv_heads``
    key/value heads, RoPE) and a SwiGLU MLP of width ``ffn_hidden``, over a ``vocab_size`` embedding.

    ``sliding_window`` W > 0: the attention of the windowed layers lets the token at position i see positions
    ``i-W+1 .. i`` only (``i - j < W``, transformers' sliding-window mask); 0: full causal attention.
    ``window_layers``: the layer ids that use the window (local), the others attending to all earlier tokens
    (global), as GPT-OSS and Gemma alternate them; empty: every layer (Mistral). ``window(layer)`` says which.

    ``head_dim``: each head's width ``d`` (0: hidden/heads, Llama's), so q is [heads*d] wide whatever ``hidden``
    is (Qwen3: hidden 2048, 32 heads of 128); ``head_size`` is the width in use. ``qk_norm``: an RMSNorm over
    each q and k head (weights ``q_norm``, ``k_norm`` [d], shared by the heads) after the projections and
    before RoPE, as Qwen3 does (``block.qk_norm_scope=projection``: one over all heads, OLMo 2's); ``norm_eps``
    is its epsilon too. ``block``: how a layer is put together (``modelpar.model.structure``; Llama's by default).

    ``attention_bias``: q, k and v projections with biases (Qwen2/2.5; Llama's and GPT-OSS's ``attention_bias``
    sets ``attention_out_bias`` too); ``attention_out_bias``: the o_proj with one. ``rope_scaling``: RoPE's
    frequencies scaled (linear, llama3, yarn; ``modelpar.model.rope``), in GQA and latent attention alike.
    """

    name: str = "custom"
    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    ffn_hidden: int = 176
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int = 0  # 0: hidden / heads
    qk_norm: bool = False
    attention_bias: bool = False  # q, k, v biases
    attention_out_bias: bool = False  # an o_proj bias
    init_std: float = 0.02
    kernels: str = "auto"  # auto | triton | torch: how the model runs, not what it is
    compile: bool = False  # each block under torch.compile
    fp8: str = "off"  # off | rowwise | tensorwise: attention and MLP GEMMs in FP8 (modelpar/model/layers/fp8.py)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    sliding_window: int = 0  # 0: full causal attention
    window_layers: list[int] = field(default_factory=list)  # the windowed layers; empty: all of them
    mtp_depth: int = 0  # multi-token prediction modules on the last stage (DeepSeek-V3: 1); 0: off
    mtp_loss_weight: float = 0.3  # lambda: loss = main + lambda / D * sum of the D modules' losses
    block: BlockStructure = field(default_factory=BlockStructure)  # norm placement, activation, scales, caps

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # read back from a checkpoint index or JSON
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        if isinstance(self.block, dict):
            self.block = BlockStructure(**self.block)
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)

    def check(self) -> None:
        """Raise ``ModelConfigError`` (one line) if no model has this shape. Called by the recipe's ``validate``
        and by every model chunk built; a config itself is plain data (Hydra fills it field by field)."""
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
        self.mla.check()
        try:
            self.rope_scaling.check()
        except RopeScalingError as exc:
            raise ModelConfigError(str(exc)) from None
        if (self.head_dim or 0) < 0:
            raise ModelConfigError(f"model.head_dim={self.head_dim} must be >= 0 (0: hidden/heads)")
        if self.mla.enabled:
            self._check_latent_attention()
        elif not self.head_dim and self.hidden % self.heads:
            raise ModelConfigError(
                f"model.hidden={self.hidden} is not a multiple of heads={self.heads}; change hidden or heads, or "
                "set model.head_dim"
            )
        elif self.head_size % 2:
            if self.head_dim:
                raise ModelConfigError(f"model.head_dim={self.head_dim} must be even for RoPE")
            raise ModelConfigError(
                f"head dim hidden/heads={self.head_size} must be even for RoPE; change model.hidden or model.heads, "
                "or set model.head_dim"
            )
        if self.heads % self.kv_heads:
            raise ModelConfigError(
                f"model.kv_heads={self.kv_heads} must divide heads={self.heads}; try kv_heads in "
                f"{[k for k in range(1, self.heads + 1) if self.heads % k == 0]}"
            )
        if self.kernels not in BACKENDS:
            raise ModelConfigError(f"model.kernels={self.kernels!r} is not one of {BACKENDS}")
        self.moe.check(self.layers)
        if self.sliding_window < 0:
            raise ModelConfigError(
                f"model.sliding_window={self.sliding_window} must be >= 0 (0: full causal attention)"
            )
        bad = [i for i in self.window_layers if not 0 <= i < self.layers]
        if bad or len(set(self.window_layers)) != len(self.window_layers):
            raise ModelConfigError(
                f"model.window_layers={list(self.window_layers)} must be distinct layer ids in 0..{self.layers - 1}"
            )
        if self.window_layers and not self.sliding_window:
            raise ModelConfigError(
                f"model.window_layers={list(self.window_layers)} needs model.sliding_window > 0; set the window or "
                "window_layers=[]"
            )
        if self.sliding_window and self.mla.enabled:
            raise ModelConfigError(
                f"model.sliding_window={self.sliding_window} is for GQA attention; latent attention (model.mla) "
                "attends every earlier token: set model.sliding_window=0"
            )
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            raise ModelConfigError(
                f"model.mtp_depth={self.mtp_depth} and model.mtp_loss_weight={self.mtp_loss_weight} must be >= 0"
            )
        self.block.check_with(self)
        if self.fp8 not in FP8_MODES:
            raise ModelConfigError(f"model.fp8={self.fp8!r} must be one of {', '.join(FP8_MODES)}")
        if self.fp8 != "off" and self.moe.enabled:
            raise ModelConfigError(
                f"model.fp8={self.fp8} covers dense layers only (the experts' grouped GEMMs have no FP8 path: "
                "torch._scaled_grouped_mm has no CPU kernel to prove it on); set model.fp8=off or model.moe.experts=0"
            )

    def _check_latent_attention(self) -> None:
        """MLA's head dims are its own (``hidden`` need not divide by ``heads``); every head has its own key and
        value, so kv_heads is heads; its projections stay in the compute dtype."""
        if self.kv_heads != self.heads:
            raise ModelConfigError(
                f"model.kv_heads={self.kv_heads} with latent attention (model.mla.kv_lora_rank > 0): every head has "
                f"its own key and value; set model.kv_heads={self.heads}"
            )
        if self.fp8 != "off":
            raise ModelConfigError(
                f"model.fp8={self.fp8} covers GQA attention only; set model.fp8=off or model.mla.kv_lora_rank=0"
            )
        for name in ("head_dim", "qk_norm", "attention_bias", "attention_out_bias"):
            if getattr(self, name):
                raise ModelConfigError(
                    f"model.{name}={getattr(self, name)} is for GQA attention; latent attention has its own head dims "
                    f"(model.mla.*) and no biases: set model.{name}={0 if name == 'head_dim' else 'false'}"
                )

    def check_layout(self, layout) -> None:
        """Raise ``LayoutError`` (one line, with a fix) if ``layout`` (a ``ParallelLayout``) cannot shard this model."""
        layout.check_model(layers=self.layers, heads=self.heads, kv_heads=self.kv_heads, ffn_hidden=self.ffn_hidden)
        if self.fp8 != "off" and layout.tp > self.kv_heads:
            raise LayoutError(
                f"model.fp8={self.fp8} with tp={layout.tp} > model.kv_heads={self.kv_heads}: replicated k/v heads get "
                "partial gradients, whose FP8 scales no rank sees whole; use tp <= kv_heads or model.fp8=off"
            )
        self.block.check_layout_with(self, layout)
        ep = getattr(layout, "ep", 1)
        if self.moe.enabled and self.moe.experts % ep:
            raise LayoutError(
                f"parallel.ep={ep} does not divide model.moe.experts={self.moe.experts}; try ep in "
                f"{self.expert_splits(layout.dp * layout.cp)}"
            )
        if ep > 1 and not self.moe.enabled:
            raise LayoutError(f"parallel.ep={ep} needs a mixture of experts (model.moe.experts > 0); set ep=1")

    def expert_splits(self, dp_cp: int) -> list[int]:
        """The ep values that split this model's experts over ranks carved from ``dp_cp`` = dp x cp ranks: the
        divisors of both (every value a hint offers passes every check)."""
        return [d for d in range(1, self.moe.experts + 1) if self.moe.experts % d == 0 and dp_cp % d == 0]

    def window(self, layer: int) -> int:
        """The sliding window of block ``layer``'s attention; 0: full causal."""
        if not self.sliding_window or (self.window_layers and layer not in self.window_layers):
            return 0
        return self.sliding_window

    @property
    def head_size(self) -> int:
        """Each attention head's width: ``head_dim``, or hidden/heads when it is 0."""
        return self.head_dim or self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """Width of q and of attention's output, ``heads * d``: what the score and value matmuls run over (hidden
        when d = hidden/heads)."""
        return self.heads * self.head_size

    @property
    def expert_ffn_hidden(self) -> int:
        return self.moe.ffn_hidden or self.ffn_hidden

    def identity(self) -> dict:
        """The fields that define what the weights mean (see the module docstring)."""
        identity = {name: getattr(self, name) for name in IDENTITY if name != "rope_scaling"}
        for name, default in OPTIONAL_IDENTITY.items():
            if identity[name] == default:
                del identity[name]
        identity["head_dim"] = self.head_size
        if self.rope_scaling.enabled:
            identity["rope_scaling"] = self.rope_scaling.identity()
        if self.mtp_depth:  # its modules' weights exist only then
            identity["mtp_depth"] = self.mtp_depth
        if self.moe.enabled:
            identity |= {"moe": self.moe.identity()}
        if self.mla.enabled:
            identity |= {"mla": self.mla.identity()}
        if self.block.changed():  # a Llama block's identity is what it was before the structure existed
            identity |= {"block": self.block.changed()}
        return identity

    # -- parameter counts (matmul weights; norms are negligible) ------------------------------------------

    def attention_params(self) -> int:
        """Matmul weights of a block's attention half: the q, k, v and o projections (latent attention: q_a, q_b
        or q_proj, kv_a_proj_with_mqa, kv_b_proj and o_proj; h x d per head for GQA)."""
        m, h, n = self.mla, self.hidden, self.heads
        if not m.enabled:
            return h * self.head_size * (2 * n + 2 * self.kv_heads)
        q = m.q_lora_rank * (h + n * m.qk_head_dim) if m.q_lora_rank else h * n * m.qk_head_dim
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + n * m.v_head_dim * h

    def attention_score_dims(self) -> tuple[int, int]:
        """Per head, the dims of the score matmul (q.k) and of the value matmul (p.v): (d, d) for GQA,
        (qk_nope + qk_rope, v_head_dim) for latent attention."""
        if self.mla.enabled:
            return self.mla.qk_head_dim, self.mla.v_head_dim
        return self.head_size, self.head_size

    def mlp_params(self, layer: int | None = None) -> int:
        """Matmul weights of a block's MLP half that a token goes through: gate, up and down of the SwiGLU; in
        a MoE ``layer`` the router and the top-k routed plus the shared experts only (active parameters).
        ``layer=None``: the mean over the layers."""
        if layer is None:
            if not self.moe.enabled:  # every layer alike (the planner asks this millions of times)
                return 3 * self.hidden * self.ffn_hidden
            return round(sum(self.mlp_params(i) for i in range(self.layers)) / self.layers)
        if not self.moe.is_moe_layer(layer):
            return 3 * self.hidden * self.ffn_hidden
        m = self.moe
        return self.hidden * m.experts + 3 * self.hidden * self.expert_ffn_hidden * (m.top_k + m.shared_experts)

    def block_params(self, layer: int | None = None) -> int:
        """Matmul weights of one block a token goes through: q, k, v, o projections and the (active) MLP."""
        return self.attention_params() + self.mlp_params(layer)

    def matmul_params(self) -> int:
        """Active matmul weights of the model (for a MoE: the top-k routed experts of each MoE layer), the
        head, and the multi-token prediction modules (``mtp_params``)."""
        if not self.moe.enabled:
            return self.layers * self.block_params(0) + self.vocab_size * self.hidden + self.mtp_params()
        blocks = sum(self.block_params(i) for i in range(self.layers))
        return blocks + self.vocab_size * self.hidden + self.mtp_params()

    def mtp_params(self, active: bool = True) -> int:
        """Matmul weights of the multi-token prediction modules a token goes through: each one's projection
        [h, 2h] and block (of the last layer's kind; ``active=False``: every expert); they share the head."""
        last = self.layers - 1
        block = self.block_params(last) if active else self.attention_params() + self.total_mlp_params(last)
        return self.mtp_depth * (2 * self.hidden * self.hidden + block)

    def total_mlp_params(self, layer: int) -> int:
        """Matmul weights of block ``layer``'s MLP half with every expert (what memory holds, not what runs)."""
        if not self.moe.is_moe_layer(layer):
            return 3 * self.hidden * self.ffn_hidden
        m = self.moe
        return self.hidden * m.experts + 3 * self.hidden * self.expert_ffn_hidden * (m.experts + m.shared_experts)

    def total_params(self, mtp: bool = True) -> int:
        """Every matmul weight and the embedding (norms are negligible): the model's size, all experts counted
        (DeepSeek-V3's "671B total"; ``mtp``: with the MTP modules, its 685B)."""
        blocks = sum(self.attention_params() + self.total_mlp_params(i) for i in range(self.layers))
        embedding = self.vocab_size * self.hidden * (1 if self.tie_embeddings else 2)
        return blocks + embedding + (self.mtp_params(active=False) if mtp else 0)
