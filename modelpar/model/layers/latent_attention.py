"""Multi-head latent attention (DeepSeek-V2/V3): keys and values of every head expanded from one low-rank
latent per token, a RoPE key part shared by the heads, tensor-parallel over heads and context-parallel with the
latent travelling.

Per token (n heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dk = dn + dr, dv = v_head_dim)::

    q   = q_b_proj(RMSNorm_q(q_a_proj(x)))  [n, dk]      (q_lora_rank 0: q_proj(x))     = [q_nope | q_pe]
    c   = kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank) | k_pe (dr)],   c_kv <- RMSNorm_kv(c_kv)
    [k_nope | v] = kv_b_proj(c_kv)  [n, dn + dv];   k = [k_nope | k_pe] (k_pe the same for every head)
    q_pe, k_pe rotated by RoPE (rotate-half pairs, tables of dim dr); softmax scale 1 / sqrt(dk)
        (under YaRN with mscale_all_dim: times ``softmax_factor``, applied as a multiple of q)
    out = o_proj(causal_attention(q, k, v))  (v's head dim dv, not dk)

The latent norms use eps 1e-6 (DeepSeek's, whatever ``model.norm_eps``). The weights carry Hugging Face's
DeepseekV3 names (``q_a_proj.weight``, ``q_a_layernorm.weight``, ``q_b_proj.weight`` or ``q_proj.weight``,
``kv_a_proj_with_mqa.weight``, ``kv_a_layernorm.weight``, ``kv_b_proj.weight``, ``o_proj.weight``). A
checkpoint written with ``rope_interleave`` (V3's RoPE on interleaved pairs) is brought to these kernels'
rotate-half pairs by ``halves_from_interleaved``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from einops import rearrange
from modelpar_kernels import apply_rope, attention, rms_norm
from torch import nn

from modelpar.model.layers.attention import DocumentIds, local_rope_tables
from modelpar.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from modelpar.model.layers.logit_max import max_attention_logits
from modelpar.model.layers.shard import ColumnPart, ShardInfo
from modelpar.model.rope import RopeScaling, softmax_factor
from modelpar.parallel.context import ContextParallelGroup, context_parallel_attention
from modelpar.parallel.latent_context import latent_context_attention
from modelpar.parallel.layout import LayoutError
from modelpar.parallel.regions import TensorParallelGroup

LATENT_NORM_EPS = 1e-6


def expand_latent(
    latent: torch.Tensor, weight: torch.Tensor, *, kv_lora_rank: int, nope: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [b, L, kv_lora_rank + dr] (normed c_kv, rotated k_pe), ``weight`` kv_b_proj's [n*(nope+dv), r]
    -> k [b, n, L, nope + dr], v [b, n, L, dv]."""
    c_kv, k_pe = latent.split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
    kv = rearrange(F.linear(c_kv, weight), "b l (n d) -> b n l d", d=nope + value_dim)
    k_nope, v = kv.split([nope, value_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    return k, v.contiguous()


class LatentAttention(nn.Module):
    """Heads split over the tp ranks; the down-projections and their norms replicated::

        x [b, s, h] --f--> down_proj = [q_a_proj | kv_a_proj_with_mqa]   (every tp rank all of it)
                                     (q_lora_rank 0: [q_proj rows of this rank's heads | kv_a_proj_with_mqa])
            -> q_a_layernorm -> q_b_proj [n/t * dk, q_lora_rank]          q [b, s, n/t, dk]
            -> kv_a_layernorm -> kv_b_proj [n/t * (dn + dv), kv_lora_rank]  k, v [b, s, n/t, dk | dv]
            -> RoPE on q_pe, k_pe; attention --> o_proj [h, n/t * dv] --g--> [b, s, h]

    ``f`` (identity forward, all-reduce backward; under sequence parallel the all-gather of x, reduce-scatter
    backward) is the only entry into the tp region: it sits before the down-projections, as for any
    column-parallel input, and q_b_proj / kv_b_proj multiply the latent locally. Each tp rank backpropagates
    only its heads' share into the replicated down-projections and latent norms, so their gradients are
    partial sums (``ShardInfo.grad_is_partial``), summed over tp by ``reduce_tensor_parallel_grads``, and
    ``f``'s all-reduce sums the shares of the input gradient.

    Under context parallelism the normed latent and the rotated k_pe of this rank's tokens cross the cp group
    (``modelpar.parallel.latent_context``), each rank expanding them with its kv_b_proj shard.

    ``rope_scaling``: the RoPE tables of q_pe and k_pe scaled (``modelpar.model.rope``); YaRN with
    ``mscale_all_dim`` (DeepSeek-V3's released config) also multiplies the softmax scale by ``softmax_factor``,
    here by multiplying q (every score is linear in q), so every attention path (single device, ring,
    all-gather, the latent exchange) scales alike without a scale threaded through each.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_theta: float,
        tp: TensorParallelGroup,
        rope_scaling: RopeScaling | None = None,
        sequence_parallel: bool = False,
        backend: str = "torch",
        cp: ContextParallelGroup | None = None,
        documents: DocumentIds | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.cp = cp or ContextParallelGroup()
        if self.cp.a2a_size > 1:
            raise LayoutError(
                f"parallel.cp_comm={self.cp.comm} exchanges heads; latent attention sends its shared latent "
                "instead: use parallel.cp_comm=ring or allgather"
            )
        if heads % tp.size:
            raise LayoutError(f"tp={tp.size} does not divide heads={heads}")
        self.documents, self.tp = documents, tp
        self.rope_theta, self.rope_scaling, self.backend = rope_theta, rope_scaling, backend
        self.q_factor = softmax_factor(rope_scaling)
        self.heads = heads // tp.size
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope, self.rope, self.value_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = dk = qk_nope_head_dim + qk_rope_head_dim
        whole = dict(offset=0, replicas=tp.size, primary=tp.rank == 0)
        kv_a = ColumnPart(
            "kv_a_proj_with_mqa.weight", kv_lora_rank + qk_rope_head_dim, size=kv_lora_rank + qk_rope_head_dim, **whole
        )
        if q_lora_rank:
            q_part = ColumnPart("q_a_proj.weight", q_lora_rank, size=q_lora_rank, **whole)
        else:
            q_part = ColumnPart.even("q_proj.weight", heads * dk, tp.rank, tp.size)
        kw = dict(sequence_parallel=sequence_parallel, cp=self.cp, device=device, dtype=dtype)
        self.down_proj = ColumnParallelLinear(hidden, [q_part, kv_a], tp, **kw)
        factory = dict(device=device, dtype=dtype)
        self.q_a_layernorm = nn.Parameter(torch.ones(q_lora_rank, **factory)) if q_lora_rank else None
        self.kv_a_layernorm = nn.Parameter(torch.ones(kv_lora_rank, **factory))
        # inside the tp region already: their forward multiplies the latent locally (see the class docstring)
        self.q_b_proj = (
            ColumnParallelLinear(q_lora_rank, heads * dk, tp, name="q_b_proj.weight", **kw) if q_lora_rank else None
        )
        self.kv_b_proj = ColumnParallelLinear(
            kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), tp, name="kv_b_proj.weight", **kw
        )
        self.o_proj = RowParallelLinear(heads * v_head_dim, hidden, tp, name="o_proj.weight", **kw)
        # QK-clip (modelpar.training.qk_clip): this rank's first head, and the running maximum of each local
        # head's logits over the step's forwards (None: not tracked)
        self.first_head = tp.rank * self.heads
        self.max_logits: torch.Tensor | None = None

    def _expand(self):
        return functools.partial(
            expand_latent, kv_lora_rank=self.kv_lora_rank, nope=self.nope, value_dim=self.value_dim
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, h] (or [b, s/t, h] with sequence parallel; s/cp under cp) -> same shape."""
        n, dr = self.heads, self.rope
        down = self.down_proj(x)  # [b, s, q_lora_rank or n*dk, kv_lora_rank + dr], the full sequence on every tp rank
        q, c_kv, k_pe = down.split([down.shape[-1] - self.kv_lora_rank - dr, self.kv_lora_rank, dr], dim=-1)
        if self.q_a_layernorm is not None:
            q = F.linear(rms_norm(q, self.q_a_layernorm, LATENT_NORM_EPS, backend=self.backend), self.q_b_proj.weight)
        q = rearrange(q, "b s (n d) -> b s n d", n=n)
        c_kv = rms_norm(c_kv, self.kv_a_layernorm, LATENT_NORM_EPS, backend=self.backend)
        cp = self.cp
        cos, sin = local_rope_tables(q.shape[1], dr, self.rope_theta, cp, q.device, self.rope_scaling)
        q_nope, q_pe = q.split([self.nope, dr], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, cos, sin, backend=self.backend)], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        k_pe = apply_rope(k_pe[:, :, None], cos, sin, backend=self.backend)[:, :, 0]
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [b, s, kv_lora_rank + dr]: all a token's keys and values
        expand = self._expand()
        documents = self.documents.current() if self.documents is not None else None
        if self.max_logits is not None and torch.is_grad_enabled():  # training forwards only, not evaluation
            with torch.no_grad():
                k = rearrange(expand(latent, self.kv_b_proj.weight)[0], "b n s d -> b s n d")
            self.max_logits = torch.maximum(self.max_logits, max_attention_logits(q, k, cp, documents=documents))
        if cp.size > 1:
            q = rearrange(q, "b s n d -> b n s d")
            out = latent_context_attention(
                q, latent, self.kv_b_proj.weight, expand, self.value_dim, cp, documents, self.backend
            )
            out = rearrange(out, "b n s d -> b s n d")
        else:
            k, v = (rearrange(t, "b n s d -> b s n d") for t in expand(latent, self.kv_b_proj.weight))
            if documents is None:
                out = attention(q, k, v, causal=True, backend=self.backend)
            else:
                out = context_parallel_attention(q, k, v, cp, documents, backend=self.backend)
        return self.o_proj(rearrange(out, "b s n d -> b s (n d)"))

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        shards = self.down_proj.logical_shards(prefix)
        # replicated over tp, each rank's gradient its heads' share (see the class docstring)
        norms = {"q_a_layernorm.weight": self.q_a_layernorm, "kv_a_layernorm.weight": self.kv_a_layernorm}
        for name, weight in norms.items():
            if weight is not None:
                shards[prefix + name] = ShardInfo(
                    param=weight,
                    local_rows=slice(None),
                    global_shape=tuple(weight.shape),
                    replicated_over_tp=self.tp.size > 1,
                    primary=self.tp.rank == 0,
                    grad_is_partial=self.tp.size > 1,
                )
        if self.q_b_proj is not None:
            shards |= self.q_b_proj.logical_shards(prefix)
        return shards | self.kv_b_proj.logical_shards(prefix) | self.o_proj.logical_shards(prefix)


def halves_from_interleaved(weight: torch.Tensor, rope: int, head_dim: int) -> torch.Tensor:
    """Rows of a q or k output weight [n*head_dim, in] whose last ``rope`` rows per head hold a RoPE part laid out
    as interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek-V3's ``rope_interleave``), reordered to the rotate-half
    pairs (x0, x_{r/2}), (x1, x_{r/2+1}), ... these kernels rotate: evens first, then odds. Queries and keys
    permuted alike keep every score, so the model computes the same function.

    For q_b_proj (or q_proj) ``head_dim`` is qk_nope + qk_rope; for kv_a_proj_with_mqa it is its whole
    kv_lora_rank + qk_rope (one "head", k_pe its last rows).
    """
    return weight[_halves_order(weight.shape[0], rope, head_dim)]


def interleaved_from_halves(weight: torch.Tensor, rope: int, head_dim: int) -> torch.Tensor:
    """The inverse of ``halves_from_interleaved``: rotate-half RoPE rows back to interleaved pairs (an export
    to a ``rope_interleave`` checkpoint)."""
    out = torch.empty_like(weight)
    out[_halves_order(weight.shape[0], rope, head_dim)] = weight
    return out


def _halves_order(rows: int, rope: int, head_dim: int) -> torch.Tensor:
    """[rows]: the interleaved row that each rotate-half row comes from."""
    order = torch.arange(head_dim)
    order[head_dim - rope :] = head_dim - rope + torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    heads = rows // head_dim
    return (torch.arange(heads)[:, None] * head_dim + order[None]).flatten()


__all__ = [
    "LATENT_NORM_EPS",
    "LatentAttention",
    "expand_latent",
    "halves_from_interleaved",
    "interleaved_from_halves",
]
