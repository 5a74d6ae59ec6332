"""Mixture of experts in place of a block's MLP (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral;
DeepSeek-V3), with the experts split over an expert-parallel group::

    x [b, s, h] -> tokens [T, h] (under tp without SP: this tp rank's T/t of them)
      -> router (``modelpar.model.router``): logits [T, E] -> softmax (or sigmoid + balancing bias), top-k
         experts (group-limited if n_group > 1) and their weights [T, k]
      -> permute: the T*k (token, expert) rows sorted by expert, once (dropped rows last, under a capacity)
      -> dispatch: all-to-all over ep, rows to the rank holding their expert, then sorted by local expert
      -> grouped GEMM: SwiGLU of each expert on its contiguous rows (w1 gate, w3 up, w2 down, as Mixtral)
      -> combine: the inverse all-to-all, then y[t] = sum_k weight[t, k] * out[t, k] (an index_add)
      (+ shared experts: a dense SwiGLU every token goes through, tp-sharded like the dense MLP)

Experts are replicated over tp, not split (no expert tensor parallelism): each expert's GEMMs stay whole,
which keeps grouped GEMMs efficient at small per-expert token counts and needs no all-reduce of the
k*T*h routed outputs over tp; instead the tp ranks split the tokens, so no work is repeated and the experts'
memory is divided by ep (up to dp x cp) rather than by tp. Their gradients are partial over tp (each tp rank
saw its own tokens) and summed there like the router's.

Auxiliary losses do not change the returned activations: their gradient is injected in backward
(``_AuxLossGradient``), so they need no path to the pipeline's last stage. The load-balancing loss is the
Switch form ``coef * E * sum_i f_i * P_i`` (f_i: fraction of the T*k routed rows sent to expert i; P_i: mean
router probability of expert i), with f and P over the tokens of the global micro-batch (micro-batch j of
every dp x cp and tp rank: at one micro-batch, the whole global batch), so it does not depend on the layout.
DeepSeek-V3's sequence-wise form (``aux_loss_scope=sequence``) takes f and P per sequence, summed over the tp
and cp ranks that share the sequence's tokens, and averages ``coef * E * sum_i f_i * P_i`` over the step's
sequences: sequences are whole inside a micro-batch, so neither the layout nor the schedule changes it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from modelpar_kernels import swiglu
from torch import nn

from modelpar.model.config import ModelConfig
from modelpar.model.grouped_mm import grouped_linear
from modelpar.model.layers import ParallelSwiGLU, ShardInfo
from modelpar.model.layers.mlp import clamped_swiglu
from modelpar.model.router import route, sequence_of_tokens, sequence_statistics
from modelpar.parallel import collectives
from modelpar.parallel.context import ContextParallelGroup
from modelpar.parallel.dtensors import is_dtensor
from modelpar.parallel.experts import ExpertParallelGroup, all_to_all_tokens, gather_tokens, split_tokens
from modelpar.parallel.regions import TensorParallelGroup

EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate [f, h], up [f, h], down [h, f]: Mixtral's names per expert
EXPERT_BIASES = ("b1", "b3", "b2")  # with model.moe.bias: [f], [f], [h], logical ``<w>.bias``


class RoutedExperts(nn.Module):
    """The weights of one ep rank's routed experts, ``w1``, ``w3`` [E/ep, f, h] and ``w2`` [E/ep, h, f], and
    their SwiGLU: a module of their own, so that ZeRO-2/3 can shard them (``fully_shard``) over the ranks
    holding the same experts while the rest of the block shards over dp x cp (``model.parallelize.apply_fsdp``)."""

    def __init__(
        self,
        local_experts: int,
        hidden: int,
        ffn_hidden: int,
        *,
        grouped_gemm: bool = True,
        backend: str = "torch",
        bias: bool = False,
        clamp: tuple[float, float] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        e, f, h, kw = local_experts, ffn_hidden, hidden, dict(device=device, dtype=dtype)
        self.grouped_gemm, self.backend, self.clamp = grouped_gemm, backend, clamp
        self.w1 = nn.Parameter(torch.zeros(e, f, h, **kw))
        self.w3 = nn.Parameter(torch.zeros(e, f, h, **kw))
        self.w2 = nn.Parameter(torch.zeros(e, h, f, **kw))
        self.b1 = self.b3 = self.b2 = None
        if bias:  # GPT-OSS: each projection of each expert with its bias
            self.b1, self.b3 = nn.Parameter(torch.zeros(e, f, **kw)), nn.Parameter(torch.zeros(e, f, **kw))
            self.b2 = nn.Parameter(torch.zeros(e, h, **kw))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by local expert (``counts`` [E/ep] each) -> w2(silu(w1 x) * w3 x), the same order (with
        biases, ``+ b[expert of the row]`` after each projection; ``clamp`` (alpha, limit): GPT-OSS's
        ``clamped_swiglu``, on the torch path)."""
        grouped = self.grouped_gemm
        gate = self._biased(grouped_linear(rows, self.w1, counts, grouped), self.b1, counts)
        up = self._biased(grouped_linear(rows, self.w3, counts, grouped), self.b3, counts)
        act = swiglu(gate, up, backend=self.backend) if self.clamp is None else clamped_swiglu(gate, up, *self.clamp)
        return self._biased(grouped_linear(act, self.w2, counts, grouped), self.b2, counts)

    @staticmethod
    def _biased(y: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
        if bias is None:
            return y
        return y + bias.to(y.dtype).repeat_interleave(counts, dim=0, output_size=y.shape[0])


class _AuxLossGradient(torch.autograd.Function):
    """Identity on ``y``; in backward, ``d(aux)/d(aux inputs) = 1`` starts the auxiliary loss's own gradient."""

    @staticmethod
    def forward(ctx, y, aux):
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


class _WholeBatchAuxGradient(torch.autograd.Function):
    """A zero in forward; in backward, the load-balancing loss's gradient with respect to this micro-batch's
    summed router probabilities, ``layer._aux_grad`` [E], which is known once every micro-batch of the step has
    routed (the whole batch's counts). Backward before that is an error: the schedule ran a backward too soon."""

    @staticmethod
    def forward(ctx, prob_sum, layer):
        ctx.layer = layer
        return prob_sum.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.layer.whole_batch_aux_grad(), None


def _in_backward() -> bool:
    """True while autograd runs a backward (a recomputed forward must not count its routing twice)."""
    return torch._C._current_graph_task_id() != -1


class MoELayer(nn.Module):
    """A block's MLP half as a mixture of experts; x: [b, s, h] (or [b, s/t, h] under sequence parallel).

    Holds the router ``gate.weight`` [E, h] (replicated over tp and ep), this ep rank's ``experts/ep`` experts
    in ``routed_experts`` as ``w1``, ``w3`` [E/ep, f, h] and ``w2`` [E/ep, h, f] (logical
    ``experts.<global id>.w1.weight`` ...), the sigmoid router's ``gate.e_score_correction_bias`` [E] (no
    gradient; moved by ``update_bias``) and optional ``shared_experts``. Routing statistics of the forward
    passes since ``take_stats()`` accumulate on the device.
    """

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelGroup,
        ep: ExpertParallelGroup | None = None,
        *,
        cp: ContextParallelGroup | None = None,
        sequence_parallel: bool = False,
        backend: str = "torch",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        moe = config.moe
        self.moe, self.tp, self.ep = moe, tp, ep or ExpertParallelGroup()
        self.cp = cp or ContextParallelGroup()
        self.sequence_parallel, self.backend = sequence_parallel and tp.size > 1, backend
        self.experts, self.top_k, self.hidden = moe.experts, moe.top_k, config.hidden
        self.ffn_hidden = config.expert_ffn_hidden
        if self.experts % self.ep.size:
            raise ValueError(f"ep={self.ep.size} does not divide the {self.experts} experts")
        self.local_experts = self.experts // self.ep.size
        self.first_expert = self.ep.rank * self.local_experts
        kw = dict(device=device, dtype=dtype)
        e, f, h = self.local_experts, self.ffn_hidden, self.hidden
        self.gate_weight = nn.Parameter(torch.zeros(self.experts, h, **kw))
        self.gate_bias = nn.Parameter(torch.zeros(self.experts, **kw)) if moe.bias else None
        clamp = (moe.swiglu_alpha, moe.swiglu_limit) if moe.activation == "clamped_swiglu" else None
        self.routed_experts = RoutedExperts(
            e, h, f, grouped_gemm=moe.grouped_gemm, backend=backend, bias=moe.bias, clamp=clamp, **kw
        )
        self.score_bias = None
        if moe.router == "sigmoid":
            self.score_bias = nn.Parameter(torch.zeros(self.experts, device=device), requires_grad=False)
        self.shared_experts = None
        if moe.shared_experts:
            self.shared_experts = ParallelSwiGLU(
                h, moe.shared_experts * f, tp, sequence_parallel=sequence_parallel, backend=backend, **kw
            )
        self.micro_batches = 1  # the step's micro-batches: each one's auxiliary loss counts 1/m
        self._stats: dict[str, torch.Tensor] | None = None
        # aux_loss_scope=global_batch: the step's routed counts, probability sums and tokens so far ([2E + 1]),
        # how many forwards and backwards of it ran, and the gradient once the whole batch has routed
        self._batch: torch.Tensor | None = None
        self._forwards = self._backwards = 0
        self._aux_grad: torch.Tensor | None = None
        self.replaying = False  # a rerun of a micro-batch of the last step (silent-corruption check)

    # -- forward -------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, h] or [b, s/t, h] -> the same shape."""
        tokens = rearrange(x, "b s h -> (b s) h")
        split = self.tp.size > 1 and not self.sequence_parallel
        if split:
            tokens = split_tokens(tokens, self.tp)
        sequence = None
        if self.moe.aux_loss_scope == "sequence" and self.moe.aux_loss_coef and torch.is_grad_enabled():
            sequence = sequence_of_tokens(x.shape[0], x.shape[1], self.tp.rank, self.tp.size, split)
        y = self._route_and_compute(tokens, sequence, x.shape[0])
        if split:
            y = gather_tokens(y, self.tp)
        y = y.view_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def _route_and_compute(self, tokens: torch.Tensor, sequence: torch.Tensor | None = None, batch: int = 1):
        """tokens [T, h] -> sum over the top-k experts of weight * expert(token) [T, h]. ``sequence`` [T]: each
        token's sequence of the ``batch`` (for the sequence-wise balance loss)."""
        n_tokens, k, n_experts = tokens.shape[0], self.top_k, self.experts
        bias = None if self.gate_bias is None else self.gate_bias.to(tokens.dtype)
        logits = F.linear(tokens, self.gate_weight.to(tokens.dtype), bias).float()  # [T, E]
        scores, chosen, weights = route(logits, self.moe, self.score_bias)  # [T, E], [T, k], [T, k]

        expert_of_row = chosen.reshape(-1)  # row t*k + j: token t's j-th expert
        counts = torch.bincount(expert_of_row, minlength=n_experts)  # [E], routed rows before any drop
        kept_rows = n_tokens * k
        if self.moe.capacity_factor > 0:
            expert_of_row, kept_counts = self._apply_capacity(expert_of_row, counts, n_tokens)
            kept_rows = int(kept_counts.sum())
        else:
            kept_counts = counts
        order = expert_of_row.argsort(stable=True)[:kept_rows]  # rows grouped by expert, dropped rows cut off
        routed = tokens[order // k]  # [kept, h]
        out = self._experts(routed, kept_counts)  # [kept, h]
        weighted = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        y = torch.zeros(tokens.shape, dtype=out.dtype, device=tokens.device).index_add_(0, order // k, weighted)
        if not _in_backward():
            self._record(counts, kept_counts, n_tokens)
        aux = self._aux_loss(logits, scores, counts, n_tokens, (sequence, chosen, batch))
        return y if aux is None else _AuxLossGradient.apply(y, aux)

    def _apply_capacity(self, expert_of_row: torch.Tensor, counts: torch.Tensor, n_tokens: int):
        """Keep each expert's first ``capacity`` rows (in token order); the others get expert id E (sorted
        last, cut off). Returns the new ids [T*k] and the kept rows per expert [E]."""
        capacity = math.ceil(self.moe.capacity_factor * n_tokens * self.top_k / self.experts)
        order = expert_of_row.argsort(stable=True)
        starts = counts.cumsum(0) - counts
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        position = position - starts[expert_of_row]  # rank of each row within its expert
        dropped = position >= capacity
        return expert_of_row.masked_fill(dropped, self.experts), counts.clamp(max=capacity)

    def _experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by (global) expert, ``counts`` [E] each -> this layer's expert outputs, same order."""
        if self.ep.size == 1:
            return self.routed_experts(routed, counts)
        ep, e_local = self.ep.size, self.local_experts
        by_rank = counts.view(ep, e_local)  # [ep, E/ep]: rows for each rank's experts
        with collectives.comm_tag("moe_dispatch"):
            received = collectives.all_to_all(by_rank, [1] * ep, [1] * ep, self.ep.group)  # [ep source, E/ep]
        # the layer's one host read: the token all-to-all needs its split sizes
        sizes = torch.cat([by_rank.sum(1), received.sum(1)]).tolist()
        send_splits, recv_splits = sizes[:ep], sizes[ep:]
        arrived = all_to_all_tokens(routed, send_splits, recv_splits, self.ep)  # [n, h] by (source, expert)
        local_expert = torch.arange(e_local, device=routed.device).repeat(ep)
        expert_of_arrived = local_expert.repeat_interleave(received.reshape(-1), output_size=sum(recv_splits))
        by_expert = expert_of_arrived.argsort(stable=True)  # (source, expert) -> (expert, source)
        out = self.routed_experts(arrived[by_expert], received.sum(0))
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        return all_to_all_tokens(out[back], recv_splits, send_splits, self.ep)

    # this ep rank's expert weights, [E/ep, ...] (held by ``routed_experts``; read them through its forward when
    # FSDP2 shards them: its pre-forward hook gathers them)
    w1 = property(lambda self: self.routed_experts.w1)
    w3 = property(lambda self: self.routed_experts.w3)
    w2 = property(lambda self: self.routed_experts.w2)

    # -- auxiliary losses and statistics -------------------------------------------------------------------

    def _batch_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum ``values`` over the ranks sharing the global micro-batch: tp (tokens split) and dp x cp."""
        groups = list(self.ep.batch_groups)
        if self.tp.size > 1:
            groups.append(self.tp.group)
        for group in groups:
            with collectives.comm_tag("moe_stats"):
                collectives.all_reduce(values, group)
        return values

    @property
    def _token_ranks(self) -> int:
        """Ranks whose tokens make up one global micro-batch."""
        return self.ep.batch_ranks * self.tp.size

    def _aux_loss(self, logits, scores, counts, n_tokens, sequences=None) -> torch.Tensor | None:
        """The surrogate whose gradient is this rank's share of the auxiliary losses' gradient, or None.

        With counts c_i and N tokens, the Switch loss ``coef*E/(N^2 k) * sum_i c_i * sum_t p_ti`` is linear in
        this rank's probabilities, its gradient ``coef*E/(N^2 k) * c`` per token (f taken as a constant, as in
        Switch). Gradients are averaged over dp x cp, so the surrogates are scaled by dp x cp; each of the m
        micro-batches' own losses (the z-loss; the aux loss per micro-batch) counts 1/m.
        """
        moe = self.moe
        if not (moe.aux_loss_coef or moe.z_loss_coef) or not torch.is_grad_enabled():
            return None
        surrogate = logits.new_zeros(())
        probs = scores if self.score_bias is None else scores / scores.sum(-1, keepdim=True)
        prob_sum = probs.sum(0)  # [E], this rank's tokens
        if moe.aux_loss_coef and moe.aux_loss_scope == "global_batch":
            self._accumulate_batch(counts, prob_sum.detach(), n_tokens)
            surrogate = surrogate + _WholeBatchAuxGradient.apply(prob_sum, self)
        elif moe.aux_loss_coef and moe.aux_loss_scope == "sequence":
            surrogate = surrogate + self._sequence_aux_loss(probs, *sequences)
        elif moe.aux_loss_coef:  # over the global micro-batch: micro-batch j of every tp and dp x cp rank
            n_global = n_tokens * self._token_ranks
            stats = torch.cat([counts.float(), prob_sum.detach()])
            stats = self._batch_sum(stats) if self._token_ranks > 1 else stats
            global_counts, global_probs = stats[: self.experts], stats[self.experts :]
            scale = moe.aux_loss_coef * self.experts / (n_global * n_global * self.top_k)
            surrogate = surrogate + scale * (global_counts * prob_sum).sum() / self.micro_batches
            if not _in_backward():
                self._stats["aux_loss"] += scale * (global_counts * global_probs).sum() / self.micro_batches
        if moe.z_loss_coef:
            n_global = n_tokens * self._token_ranks
            z_loss = moe.z_loss_coef * logits.logsumexp(-1).square().sum() / n_global
            surrogate = surrogate + z_loss / self.micro_batches
        return surrogate * self.ep.batch_ranks

    def _sequence_aux_loss(self, probs: torch.Tensor, sequence: torch.Tensor, chosen: torch.Tensor, batch: int):
        """The surrogate of DeepSeek-V3's sequence-wise balance loss for this rank's tokens.

        Sequence j of the micro-batch, with T_j tokens, counts c_ji and normalised-score sums S_ji (over its
        tokens on every tp and cp rank): ``coef * E/(k T_j^2) * sum_i c_ji * S_ji``, averaged over the global
        micro-batch's b * dp sequences and counted 1/m. Linear in this rank's part of S (c held constant)."""
        table, prob_sums = sequence_statistics(sequence, chosen, probs, batch)
        table = torch.cat([table, prob_sums.detach()], 1)  # [b, E + 1 + E]
        for group, size in ((self.tp.group, self.tp.size), (self.cp.group, self.cp.size)):
            if size > 1:
                with collectives.comm_tag("moe_stats"):
                    collectives.all_reduce(table, group)
        e = self.experts
        counts, tokens, whole_sums = table[:, :e], table[:, e], table[:, e + 1 :]
        sequences = batch * (self.ep.batch_ranks // self.cp.size)  # b * dp
        scale = self.moe.aux_loss_coef * e / (self.top_k * tokens.square() * sequences * self.micro_batches)
        surrogate = (scale.unsqueeze(1) * counts * prob_sums).sum()
        if not _in_backward():
            value = (scale.unsqueeze(1) * counts * whole_sums).sum().reshape(1).double()
            if self.ep.batch_ranks > 1:  # every dp replica's sequences; cp ranks hold the same value
                value = self._dp_sum(value)
            self._stats["aux_loss"] += value[0]
        return surrogate

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over dp x cp of a value that tp ranks already share (divided by cp: cp ranks share it too)."""
        value = value / self.cp.size
        for group in self.ep.batch_groups:
            with collectives.comm_tag("moe_stats"):
                collectives.all_reduce(value, group)
        return value

    def _accumulate_batch(self, counts: torch.Tensor, prob_sum: torch.Tensor, n_tokens: int) -> None:
        """Add a micro-batch's routing to the step's; after the step's last forward, sum it over the batch's ranks
        (one all-reduce per layer per step) and fix the aux loss's gradient for every micro-batch's backward."""
        if _in_backward() or self.replaying:  # a recomputed forward or a rerun: already counted
            return
        if self._forwards == 0:
            self._batch = torch.zeros(2 * self.experts + 1, dtype=torch.float64, device=counts.device)
            self._aux_grad = None
        self._batch[: self.experts] += counts
        self._batch[self.experts : 2 * self.experts] += prob_sum
        self._batch[-1] += n_tokens
        self._forwards += 1
        if self._forwards < self.micro_batches:
            return
        batch = self._batch_sum(self._batch) if self._token_ranks > 1 else self._batch
        global_counts, global_probs, n_global = batch[: self.experts], batch[self.experts : -1], batch[-1]
        scale = self.moe.aux_loss_coef * self.experts / (n_global * n_global * self.top_k)
        self._aux_grad = (scale * global_counts).float()
        self._stats["aux_loss"] += scale * (global_counts * global_probs).sum()

    def whole_batch_aux_grad(self) -> torch.Tensor:
        """[E]: d(aux loss)/d(summed probabilities of one micro-batch); counts the step's backwards."""
        if self._aux_grad is None:
            raise RuntimeError(
                "model.moe.aux_loss_scope=global_batch: a backward ran before every micro-batch of the step had "
                "routed; run a schedule with all forwards first (gpipe) or set model.moe.aux_loss_scope=micro_batch"
            )
        if not self.replaying:
            self._backwards += 1
            if self._backwards == self.micro_batches:  # the step is done: the next forward starts the next one
                self._forwards = self._backwards = 0
        return self._aux_grad

    def begin_step(self) -> None:
        """Forget a step that did not finish (a failed step leaves forwards without their backwards)."""
        self._forwards = self._backwards = 0
        self._aux_grad = None

    def _record(self, counts: torch.Tensor, kept: torch.Tensor, n_tokens: int) -> None:
        if self._stats is None:
            device = counts.device
            self._stats = {
                "tokens_per_expert": torch.zeros(self.experts, dtype=torch.float64, device=device),
                "dropped": torch.zeros((), dtype=torch.float64, device=device),
                "routed": torch.zeros((), dtype=torch.float64, device=device),
                "aux_loss": torch.zeros((), dtype=torch.float64, device=device),
            }
        self._stats["tokens_per_expert"] += counts
        self._stats["dropped"] += (counts - kept).sum()
        self._stats["routed"] += n_tokens * self.top_k

    def take_stats(self) -> dict[str, torch.Tensor] | None:
        """This rank's routing statistics since the last call (device tensors; None if nothing ran):
        ``tokens_per_expert`` [E] (routed rows before drops), ``dropped`` and ``routed`` rows, ``aux_loss``
        (global, the same on every rank; 0 without an aux loss). Sum the counts over the batch's ranks for
        the global values (``update_bias`` does)."""
        stats, self._stats = self._stats, None
        return stats

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: ``b_i += rate * sign(mean load - load_i)`` from the
        global batch's loads (the same on every rank, so every replica moves its bias alike)."""
        if self.score_bias is None or not self.moe.bias_update_rate:
            return
        load = tokens_per_expert.to(self.score_bias.dtype)
        self.score_bias += self.moe.bias_update_rate * torch.sign(load.mean() - load)

    # -- logical tensors -----------------------------------------------------------------------------------

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        """``gate.weight`` and, per expert held here, ``experts.<global id>.w1/w3/w2.weight`` (Mixtral names);
        all replicated over tp with gradients partial over tp when tp > 1 (each tp rank routes its tokens)."""
        tp = self.tp.size > 1
        kw = dict(replicated_over_tp=tp, primary=self.tp.rank == 0, grad_is_partial=tp)
        shards = {
            prefix + "gate.weight": ShardInfo(self.gate_weight, slice(None), (self.experts, self.hidden), **kw),
        }
        if self.gate_bias is not None:
            shards[prefix + "gate.bias"] = ShardInfo(self.gate_bias, slice(None), (self.experts,), **kw)
        if self.score_bias is not None:
            shards[prefix + "gate.e_score_correction_bias"] = ShardInfo(
                self.score_bias, slice(None), (self.experts,), replicated_over_tp=tp, primary=self.tp.rank == 0
            )
        for name, logical_name in self._expert_tensors():
            param = getattr(self.routed_experts, name)
            for e in range(self.local_experts):
                logical = f"{prefix}experts.{self.first_expert + e}.{logical_name}"
                shards[logical] = ShardInfo(param, e, tuple(param.shape[1:]), **kw)
        if self.shared_experts is not None:
            shards |= self.shared_experts.logical_shards(prefix + "shared_experts.")
        return shards

    @torch.no_grad()
    def gather_experts(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every expert's weights, from all ep ranks (collective over ep; nothing to gather at ep=1)."""
        if self.ep.size == 1:
            return {}
        state = {}
        for name, logical_name in self._expert_tensors():
            mine = getattr(self.routed_experts, name).detach()
            if is_dtensor(mine):  # ZeRO-2/3: sharded over the ranks holding the same experts
                mine = mine.full_tensor()
            with collectives.comm_tag("export"):
                whole = collectives.all_gather(mine, self.ep.group)  # [E, ...]
            state |= {f"{prefix}experts.{e}.{logical_name}": whole[e] for e in range(self.experts)}
        return state

    def _expert_tensors(self) -> list[tuple[str, str]]:
        """(parameter of ``routed_experts``, logical name after ``experts.<id>.``) of each expert tensor."""
        names = [(w, f"{w}.weight") for w in EXPERT_WEIGHTS]
        if self.moe.bias:
            names += [(b, f"{w}.bias") for b, w in zip(EXPERT_BIASES, EXPERT_WEIGHTS, strict=True)]
        return names

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters split over ep (gradients averaged over the expert data-parallel group)."""
        return list(self.routed_experts.parameters())
