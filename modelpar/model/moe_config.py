"""The mixture-of-experts part of a model's recipe (``model.moe``): which layers route to experts, how they
route (softmax or DeepSeek-V3's sigmoid with groups and a balancing bias), the balance losses and the experts'
shape, with the checks that refuse a mixture that cannot run, and the fields that are part of the model's
identity (``MoEConfig.IDENTITY``, plus the routing fields that differ from ``ROUTING_DEFAULTS``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from modelpar.model.structure import ModelConfigError

ROUTERS = ("softmax", "sigmoid")
AUX_LOSS_SCOPES = ("global_batch", "micro_batch", "sequence")
# routing fields outside MoEConfig.IDENTITY that change what the weights compute: part of the identity only when
# they differ from these defaults, so older mixtures keep their identity
ROUTING_DEFAULTS = dict(
    n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=0, bias=False, activation="swiglu"
)
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclass
class MoEConfig:
    """Mixture of experts in place of the MLP of chosen layers (``modelpar.model.moe``); ``experts=0``: dense.

    ``router``: softmax (Mixtral: softmax over all experts, top-k renormalised) or sigmoid (DeepSeek-V3: sigmoid
    scores, top-k chosen on score + a per-expert bias that is moved by ``bias_update_rate`` towards balance after
    every step, no gradient; the chosen scores renormalised). ``aux_loss_coef``: the Switch load-balancing loss
    ``E * sum_i f_i * P_i``, over the tokens of the whole global batch (``aux_loss_scope=global_batch``: needs
    every micro-batch's forward before the first backward, so GPipe or one micro-batch) or of each global
    micro-batch (``micro_batch``, any schedule; the whole batch at one micro-batch); ``z_loss_coef``: the
    router z-loss (a mean over tokens, the same either way). ``aux_loss_scope=sequence`` is DeepSeek-V3's
    sequence-wise balance loss instead (eq. 17-20): ``coef * sum_i f_i * P_i`` per sequence (f_i = E/(k T) *
    tokens of the sequence routed to i, P_i the mean normalised score over its T tokens), averaged over the
    step's sequences; sequences split by cp or tp are reduced whole first, so any layout and schedule gives it.
    ``norm_topk_prob``: the top-k routing weights are renormalised to sum to 1 (Mixtral, Qwen3-30B-A3B, V3);
    false: each is its score as the router gave it.
    DeepSeek-V3 routing: ``n_group`` groups of experts/n_group experts; a group scores the sum of its top-2
    choice scores (score + bias); the ``topk_group`` best groups stay and the top-k experts are chosen among
    theirs. The chosen scores are renormalised (``norm_topk_prob``), then multiplied by
    ``routed_scaling_factor``. ``first_k_dense_replace``: layers below it keep the dense MLP of width
    model.ffn_hidden (DeepSeek-V3: 3 dense layers of 18432, experts of 2048).
    ``capacity_factor`` 0 is dropless; > 0 caps each expert at ``ceil(factor * tokens * top_k / experts)`` of a
    rank's tokens per micro-batch, the rest dropped (their MLP output is zero; the dropped fraction is reported).
    MoE layers: ``layers`` if given, else every layer ``i`` with ``i % every == 0``.
    """

    IDENTITY = ("experts", "top_k", "ffn_hidden", "shared_experts", "router", "every", "layers", "norm_topk_prob")

    experts: int = 0
    top_k: int = 2
    ffn_hidden: int = 0  # width of each expert's SwiGLU; 0: model.ffn_hidden
    every: int = 1
    layers: list[int] = field(default_factory=list)
    shared_experts: int = 0  # dense SwiGLU experts of width ffn_hidden that every token also goes through
    router: str = "softmax"
    aux_loss_coef: float = 0.0
    aux_loss_scope: str = "global_batch"  # global_batch | micro_batch
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float = 0.0
    grouped_gemm: bool = True  # torch's grouped matmul where the shapes allow; false: one matmul per expert
    n_group: int = 1  # groups of experts for group-limited routing (1: every expert eligible)
    topk_group: int = 1  # groups kept per token
    routed_scaling_factor: float = 1.0  # the routed experts' weighted sum multiplied by this
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    first_k_dense_replace: int = 0  # layers 0..k-1 dense whatever ``layers`` / ``every`` say
    bias: bool = False  # the router and every expert's projections with biases (GPT-OSS)
    activation: str = "swiglu"  # swiglu | clamped_swiglu: GPT-OSS's (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_alpha: float = 1.702  # clamped_swiglu's alpha
    swiglu_limit: float = 7.0  # clamped_swiglu's clamp: gate <= limit, |up| <= limit

    @property
    def enabled(self) -> bool:
        return self.experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        if not self.enabled or layer < self.first_k_dense_replace:
            return False
        return layer in self.layers if self.layers else layer % self.every == 0

    def check(self, layers: int) -> None:
        if not self.enabled:
            if self.experts < 0:
                raise ModelConfigError(f"model.moe.experts={self.experts} must be >= 0 (0: dense MLP)")
            return
        if not 1 <= self.top_k <= self.experts:
            raise ModelConfigError(
                f"model.moe.top_k={self.top_k} must be in 1..experts={self.experts}; lower top_k or add experts"
            )
        if self.router not in ROUTERS:
            raise ModelConfigError(f"model.moe.router={self.router!r} is not one of {ROUTERS}")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ModelConfigError(f"model.moe.aux_loss_scope={self.aux_loss_scope!r} is not one of {AUX_LOSS_SCOPES}")
        for name in ("ffn_hidden", "shared_experts", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ModelConfigError(f"model.moe.{name}={getattr(self, name)} must be >= 0")
        if self.every < 1:
            raise ModelConfigError(f"model.moe.every={self.every} must be >= 1")
        bad = [i for i in self.layers if not 0 <= i < layers]
        if bad or len(set(self.layers)) != len(self.layers):
            raise ModelConfigError(
                f"model.moe.layers={list(self.layers)} must be distinct layer ids in 0..{layers - 1}"
            )
        if self.capacity_factor < 0:
            raise ModelConfigError(f"model.moe.capacity_factor={self.capacity_factor} must be >= 0 (0: dropless)")
        self._check_routing(layers)
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ModelConfigError(f"model.moe.activation={self.activation!r} is not one of {EXPERT_ACTIVATIONS}")
        if self.bias_update_rate and self.router != "sigmoid":
            raise ModelConfigError(
                "model.moe.bias_update_rate is the sigmoid router's balancing bias; set model.moe.router=sigmoid "
                "or bias_update_rate=0"
            )

    def _check_routing(self, layers: int) -> None:
        e, g = self.experts, self.n_group
        if g < 1 or e % g:
            divisors = [d for d in range(1, e + 1) if e % d == 0]
            raise ModelConfigError(f"model.moe.n_group={g} must divide experts={e}; try n_group in {divisors}")
        if not 1 <= self.topk_group <= g:
            raise ModelConfigError(f"model.moe.topk_group={self.topk_group} must be in 1..n_group={g}")
        if self.top_k > self.topk_group * (e // g):
            raise ModelConfigError(
                f"model.moe.top_k={self.top_k} exceeds the {self.topk_group * (e // g)} experts of topk_group="
                f"{self.topk_group} groups of {e // g}; raise topk_group or lower top_k"
            )
        if not self.routed_scaling_factor > 0:
            raise ModelConfigError(f"model.moe.routed_scaling_factor={self.routed_scaling_factor} must be > 0")
        if not 0 <= self.first_k_dense_replace < layers:
            raise ModelConfigError(
                f"model.moe.first_k_dense_replace={self.first_k_dense_replace} must be in 0..{layers - 1} "
                "(at least the last layer a mixture of experts)"
            )
        if not any(self.is_moe_layer(i) for i in range(layers)):
            raise ModelConfigError(
                f"model.moe.first_k_dense_replace={self.first_k_dense_replace} leaves no MoE layer among "
                f"model.moe.layers={list(self.layers)}; lower it or set model.moe.experts=0"
            )

    def identity(self) -> dict:
        routing = {
            name: getattr(self, name) for name, default in ROUTING_DEFAULTS.items() if getattr(self, name) != default
        }
        if self.activation == "clamped_swiglu":
            routing |= {"swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit}
        return {name: getattr(self, name) for name in self.IDENTITY} | {"layers": list(self.layers)} | routing
