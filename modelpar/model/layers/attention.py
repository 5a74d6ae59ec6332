"""Tensor-parallel causal self-attention with RoPE and grouped-query heads, context-parallel over the sequence,
optionally document-causal (a token sees only earlier tokens of its own document) and sliding-window (only the
``window`` latest positions up to its own)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange
from modelpar_kernels import apply_rope, attention, rope_tables
from torch import nn

from modelpar.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from modelpar.model.layers.logit_max import max_attention_logits
from modelpar.model.layers.norm import ProjectionRMSNorm, RMSNorm
from modelpar.model.layers.shard import ColumnPart, ShardInfo
from modelpar.model.rope import RopeScaling, table_options
from modelpar.parallel.context import ContextParallelGroup, context_parallel_attention, local_positions
from modelpar.parallel.regions import TensorParallelGroup

# A plain dict, not functools.lru_cache: torch.compile traces through an lru_cache wrapper (so every compiled
# block would rebuild the tables) but takes a tensor found in a dict as a graph input.
_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_ROPE_TABLES_KEPT = 8  # a run meets a few sequence lengths (train, eval); generation's growing context cycles


def cached_rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables(seq_len, head_dim, theta)`` on ``device`` (its frequencies and factor scaled by ``scaling``,
    ``modelpar.model.rope``), built once and shared by every attention layer.

    cos, sin: [seq_len, head_dim / 2], fp32 whatever the activations' dtype (the rotation runs in fp32), so the
    dtype is not part of the key. Read-only: every layer and every step gets the same tensors.
    """
    scaled = scaling is not None and scaling.enabled
    key = (seq_len, head_dim, theta, str(device), scaling.key() if scaled else None)
    tables = _ROPE_TABLES.get(key)
    if tables is None:
        if len(_ROPE_TABLES) >= _ROPE_TABLES_KEPT:
            _ROPE_TABLES.pop(next(iter(_ROPE_TABLES)))  # the oldest
        # normal tensors even when first asked for under inference_mode, so a later training step can save them
        with torch.inference_mode(False):
            options = table_options(head_dim, theta, scaling)
            tables = _ROPE_TABLES[key] = rope_tables(seq_len, head_dim, theta, device=device, **options)
    return tables


def local_rope_tables(
    local_len: int,
    head_dim: int,
    theta: float,
    cp: ContextParallelGroup,
    device: torch.device,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [local_len, head_dim / 2] at this rank's global positions: ``0 .. local_len - 1``, or under cp
    the positions of its two chunks of the ``local_len * cp.size``-token sequence (rows of the whole sequence's
    tables, scaled or not)."""
    seq = local_len * cp.size
    cos, sin = cached_rope_tables(seq, head_dim, theta, device, scaling)
    if cp.size > 1:
        positions = local_positions(seq, cp.size, cp.rank, device)
        cos, sin = cos[positions], sin[positions]
    return cos, sin


class DocumentIds:
    """Where a chunk's attention layers find the document ids of the micro-batch being computed.

    ``source()`` returns ids [b, s] of the whole sequence (every cp rank the same), or None for plain causal
    attention; no source (the default) is plain causal attention. The training step sets it when
    ``data.document_mask`` is on; a backward that reruns a forward (recompute) asks it again for the same
    micro-batch.
    """

    def __init__(self) -> None:
        self.source: Callable[[], torch.Tensor | None] | None = None

    def current(self) -> torch.Tensor | None:
        return None if self.source is None else self.source()


class ParallelAttention(nn.Module):
    """Heads split over the tp ranks: q, k, v fused in one column-parallel weight, output row-parallel::

        x [b, s, h] --f--> qkv_proj [(hq + 2*hkv_local)*d / t, h] -> q [b, s, hq/t, d], k, v [b, s, hkv_local, d]
                    [--> q_norm(q), k_norm(k): RMSNorm over d of each head]
                    --> RoPE(q, k), causal attention per head --> o_proj [h, hq*d/t] --g--> [b, s, h]

    ``head_dim`` (d; None: hidden/heads) need not be hidden/heads. ``qk_norm``: the per-head RMSNorms (weights
    [d], shared by the heads, replicated over tp); each tp rank normalises only its own heads, so their
    gradients are partial over tp (``ShardInfo.grad_is_partial``) whatever the sequence parallelism.

    Key/value heads (grouped-query attention, hkv heads shared by groups of hq/hkv query heads):

    - tp divides hkv: sharded like the query heads, rank r holds kv heads ``r*hkv/t .. (r+1)*hkv/t``;
    - hkv divides tp: replicated, rank r holds the one kv head its query heads use, ``r // (t/hkv)``. The
      t/hkv ranks sharing it each compute only their query heads' part of its gradient
      (``ShardInfo.grad_is_partial``); ``reduce_tensor_parallel_grads`` sums them.

    Under context parallelism (``cp``) x holds this cp rank's two chunks of the sequence
    (``modelpar.parallel.context``): RoPE uses their global positions and attention runs over the cp group.
    ``fp8`` (off | rowwise | tensorwise): the qkv and output projections' GEMMs in FP8 (attention itself stays
    in the compute dtype). ``window`` W > 0: the token at global position i attends to positions ``i-W+1 .. i``
    (composed with the document mask); a window as long as the sequence is full causal attention.
    ``bias``: q, k and v biases (Qwen2), split over tp with their projections' rows; ``out_bias``: an o_proj
    bias, added once after the tp reduction (``RowParallelLinear``). ``rope_scaling``: RoPE's tables scaled
    (``modelpar.model.rope``).

    ``qk_norm="projection"``: one RMSNorm over all heads of q (and one of k) before they are split into heads
    (OLMo 2; ``ProjectionRMSNorm``, weights sharded with the heads); ``norm_offset`` 1: the per-head norms scale
    by ``1 + weight`` (Gemma). ``query_scale`` S > 0: scores scaled by 1/sqrt(S) instead of 1/sqrt(d), by
    scaling q before attention, so every kernel and context-parallel exchange runs unchanged. ``softcap`` > 0:
    scores capped by ``softcap * tanh(s / softcap)`` (the torch path, inside each block of the cp exchange).
    ``sinks``: one learned logit per head (``sinks`` [heads], sharded with the heads) in each row's softmax, a
    key of value 0 that every query sees (GPT-OSS; the torch path, merged into the cp online softmax).
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        rope_theta: float,
        tp: TensorParallelGroup,
        *,
        head_dim: int | None = None,
        qk_norm: bool | str = False,
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        query_scale: float = 0.0,
        softcap: float = 0.0,
        sinks: bool = False,
        sequence_parallel: bool = False,
        backend: str = "torch",
        cp: ContextParallelGroup | None = None,
        documents: DocumentIds | None = None,
        window: int = 0,
        fp8: str = "off",
        bias: bool = False,
        out_bias: bool = False,
        rope_scaling: RopeScaling | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.cp = cp or ContextParallelGroup()
        self.documents = documents
        self.window = window
        self.head_dim = d = head_dim or hidden // heads
        self.rope_theta, self.rope_scaling, self.backend = rope_theta, rope_scaling, backend
        self.heads = heads // tp.size
        if kv_heads % tp.size == 0:
            self.kv_heads, first_kv, replicas = kv_heads // tp.size, tp.rank * kv_heads // tp.size, 1
        else:
            replicas = tp.size // kv_heads
            self.kv_heads, first_kv = 1, tp.rank // replicas
        kv = [
            ColumnPart(name, kv_heads * d, first_kv * d, self.kv_heads * d, replicas, tp.rank % replicas == 0)
            for name in ("k_proj.weight", "v_proj.weight")
        ]
        parts = [ColumnPart.even("q_proj.weight", heads * d, tp.rank, tp.size), *kv]
        # QK-clip (modelpar.training.qk_clip): the global heads held here, and the running maximum of each local
        # query head's logits over the step's forwards (None: not tracked)
        self.total_heads, self.total_kv_heads = heads, kv_heads
        self.first_head, self.first_kv_head = tp.rank * self.heads, first_kv
        self.max_logits: torch.Tensor | None = None
        kw = dict(sequence_parallel=sequence_parallel, fp8=fp8, cp=self.cp, device=device, dtype=dtype)
        self.qkv_proj = ColumnParallelLinear(hidden, parts, tp, bias=bias, **kw)
        self.o_proj = RowParallelLinear(heads * d, hidden, tp, name="o_proj.weight", bias=out_bias, **kw)
        self.query_factor = (d / query_scale) ** 0.5 if query_scale else 1.0
        self.softcap = softcap
        self.tp_size = tp.size
        self.sinks = nn.Parameter(torch.zeros(self.heads, device=device, dtype=dtype)) if sinks else None
        self.q_norm = self.k_norm = None
        self.projection_norm = qk_norm == "projection"
        if self.projection_norm:  # over whole projections, sharded like their heads
            norm = dict(tp=tp, device=device, dtype=dtype)
            self.q_norm = ProjectionRMSNorm(heads * d, parts[0].offset, self.heads * d, norm_eps, **norm)
            self.k_norm = ProjectionRMSNorm(kv_heads * d, first_kv * d, self.kv_heads * d, norm_eps, **norm)
        elif qk_norm:  # each rank sees its own heads only: the weights' gradients are partial over tp
            norm = dict(backend=backend, partial_over_tp=True, offset=norm_offset, device=device, dtype=dtype)
            self.q_norm = RMSNorm(d, norm_eps, tp, **norm)
            self.k_norm = RMSNorm(d, norm_eps, tp, **norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, h] (or [b, s/t, h] with sequence parallel; s/cp under cp) -> same shape. Positions start
        at 0 (under cp: the global positions of this rank's chunks)."""
        d = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        if self.projection_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (rearrange(t, "b s (n d) -> b s n d", d=d) for t in (q, k, v))
        if self.q_norm is not None and not self.projection_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cp = self.cp
        seq = q.shape[1] * cp.size
        cos, sin = local_rope_tables(q.shape[1], d, self.rope_theta, cp, q.device, self.rope_scaling)
        q, k = apply_rope(q, cos, sin, backend=self.backend), apply_rope(k, cos, sin, backend=self.backend)
        if self.query_factor != 1.0:
            q = q * self.query_factor
        documents = self.documents.current() if self.documents is not None else None
        window = self.window if self.window < seq else 0  # a window spanning the sequence masks nothing
        if self.max_logits is not None and torch.is_grad_enabled():  # training forwards only, not evaluation
            seen = max_attention_logits(q, k, cp, window=window, documents=documents)
            self.max_logits = torch.maximum(self.max_logits, seen)
        if cp.size == 1 and documents is None:
            out = attention(
                q, k, v, causal=True, backend=self.backend, window=window, softcap=self.softcap, sinks=self.sinks
            )
        else:
            out = context_parallel_attention(
                q, k, v, cp, documents, backend=self.backend, window=window, softcap=self.softcap, sinks=self.sinks
            )
        return self.o_proj(rearrange(out, "b s n d -> b s (n d)"))

    def logical_shards(self, prefix: str = "") -> dict[str, ShardInfo]:
        shards = self.qkv_proj.logical_shards(prefix) | self.o_proj.logical_shards(prefix)
        if self.q_norm is not None:
            shards |= self.q_norm.logical_shards(prefix + "q_norm.") | self.k_norm.logical_shards(prefix + "k_norm.")
        if self.sinks is not None:
            global_shape = (self.heads * self.tp_size,)
            shards[prefix + "sinks"] = ShardInfo(self.sinks, slice(None), global_shape, dim=0, offset=self.first_head)
        return shards
