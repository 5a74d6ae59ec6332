"""Context parallelism: the sequence split over the ``cp`` ranks, and attention across the split.

Load-balanced causal split: the sequence is cut into ``2*cp`` chunks and cp rank ``r`` holds chunks ``r`` and
``2cp-1-r``, so every rank has as many early (cheap) as late (expensive) queries::

    cp=2, seq 8:   chunks   0:[0 1]  1:[2 3]  2:[4 5]  3:[6 7]
                   rank 0 holds [0 1 6 7], rank 1 holds [2 3 4 5]

Everything else in a block (norms, projections, MLP) is per token and needs nothing; attention needs every
earlier key, four ways (``parallel.cp_comm``):

- ring: K/V blocks (kv heads only) travel around the cp ring with ``batch_isend_irecv``; the next block's
  transfer is posted before the current block is computed. Each block gives a partial output and its
  log-sum-exp, merged as ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a e^(lse_a-lse) + o_b e^(lse_b-lse)``.
  Backward recomputes each block's probabilities from the merged lse (FlashAttention-2's backward, one block
  at a time) and passes the dK/dV partial sums around the ring with the K/V they belong to. With the balanced
  split, the block from a lower rank is seen by all local queries through its first chunk only, the block from
  a higher rank by the second local chunk only: half of each off-diagonal block is skipped, never computed.
- all-gather: K/V of every cp rank gathered up front (kv heads only), the local queries attend to the same
  blocks as the ring's; backward gathers K/V again (rather than keeping cp x the K/V per layer) and
  reduce-scatters their gradient back to the ranks that own them.

- alltoall / hybrid (``modelpar.parallel.ulysses``): q/k/v exchanged from a sequence shard to a head shard over
  all of cp (alltoall) or over groups of ``parallel.cp_a2a`` consecutive cp ranks (hybrid, the ring above
  across the groups), and the output back.

All compute exactly the attention of the whole sequence (with document masking: only earlier tokens of the
same document, ``documents`` being per-token document ids of the whole sequence).

A sliding ``window`` W (a query at global position i sees positions ``i-W+1 .. i``) is applied in global
positions: the ring and the all-gather then cut each (queries x visiting K/V) block into its four chunk pairs
(contiguous positions each, so the kernel's window needs one offset) and compute only the pairs some query of
which sees some key; a pair wholly outside the window, or wholly after the queries, is never computed. The
ring still passes every K/V block (and its dK/dV) around: with the balanced split a rank's two chunks have
neighbours on both sides of the ring, so no transfer can be dropped, only compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from modelpar_kernels import (
    BlockMask,
    accumulation_dtype,
    attention,
    attention_math_reference,
    block_attention_backward,
    block_attention_forward,
)

from modelpar.parallel.collectives import all_gather, blocking, comm_tag, current_tag, reduce_scatter, send_recv
from modelpar.parallel.kept import kept_result
from modelpar.parallel.ulysses import exchange_qkv, sequence_from_heads

CP_COMMS = ("ring", "allgather", "alltoall", "hybrid")


@dataclass(frozen=True, eq=False)
class ContextParallelGroup:
    """The cp group attention talks over: process group, its global ranks (ring order), this rank's index.

    ``ContextParallelGroup()`` is no context parallelism (size 1): every helper below is the identity.
    ``comm`` alltoall / hybrid (``modelpar.parallel.ulysses``): heads are exchanged over ``a2a_group``, the
    ``a2a_size`` consecutive cp ranks of this rank's all-to-all group (all of cp for alltoall), and a ring over
    ``ring_group`` (hybrid: the ranks at this rank's place in every all-to-all group) runs across the groups.
    """

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1
    ranks: tuple[int, ...] = field(default=(0,))
    comm: str = "ring"
    a2a_size: int = 1
    a2a_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size > 1 and (self.group is None or len(self.ranks) != self.size):
            raise ValueError(f"context parallelism over {self.size} ranks needs a process group and its ranks")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"cp rank {self.rank} is outside a group of {self.size}")
        if self.comm not in CP_COMMS:
            raise ValueError(f"cp_comm={self.comm!r} must be one of {CP_COMMS}")
        if self.a2a_size < 1 or self.size % self.a2a_size:
            raise ValueError(f"an all-to-all group of {self.a2a_size} cp ranks must divide cp={self.size}")
        if self.a2a_size > 1 and self.a2a_group is None:
            raise ValueError(f"an all-to-all over {self.a2a_size} cp ranks needs its process group")
        if 1 < self.a2a_size < self.size and self.ring_group is None:
            raise ValueError(f"a ring across {self.size // self.a2a_size} all-to-all groups needs its process group")

    @classmethod
    def of(cls, groups, comm: str = "ring", a2a: int = 0) -> ContextParallelGroup:
        """The cp part of a ``modelpar.parallel.groups.ParallelGroups``; ``a2a``: the all-to-all group size of
        ``comm="hybrid"`` (its cp divisor; ``cp`` is plain alltoall, 1 the plain ring). Hybrid's sub-groups are
        made collectively on first use (``ParallelGroups.context_split``)."""
        cp = groups.layout.cp
        if cp == 1:
            return cls(comm=comm)
        base = dict(group=groups.cp_group, rank=groups.cp_rank, size=cp, ranks=groups.cp_ranks)
        n = cp if comm == "alltoall" else a2a if comm == "hybrid" else 1
        if n == cp:
            return cls(**base, comm=comm, a2a_size=cp, a2a_group=groups.cp_group)
        if n == 1:
            return cls(**base, comm="ring" if comm == "hybrid" else comm)
        a2a_group, ring_group = groups.context_split(n)
        return cls(**base, comm=comm, a2a_size=n, a2a_group=a2a_group, ring_group=ring_group)

    def ring(self) -> ContextParallelGroup:
        """What runs after the heads are exchanged: the ring across the all-to-all groups (size 1 when the
        all-to-all spans cp), this rank's group being its place in it."""
        n = self.a2a_size
        if n == self.size:
            return ContextParallelGroup()
        ranks = self.ranks[self.rank % n :: n]
        return ContextParallelGroup(group=self.ring_group, rank=self.rank // n, size=self.size // n, ranks=ranks)


def local_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [seq/cp] of cp rank ``rank``'s tokens: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    if seq % (2 * cp):
        raise ValueError(f"context parallelism needs the sequence length {seq} divisible by 2*cp={2 * cp}")
    c = seq // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([first, first + (2 * cp - 1 - 2 * rank) * c])


def split_for_context(x: torch.Tensor, cp: ContextParallelGroup, dim: int = 1) -> torch.Tensor:
    """This cp rank's two chunks of ``x`` along ``dim`` (``[b, s, ...] -> [b, s/cp, ...]``); no communication."""
    if cp.size == 1:
        return x
    index = local_positions(x.shape[dim], cp.size, cp.rank, x.device)
    return x.index_select(dim, index)


def merge_from_context(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``split_for_context``: every cp rank's part (in cp rank order) back in sequence order."""
    cp = len(parts)
    seq = parts[0].shape[dim] * cp
    order = torch.cat([local_positions(seq, cp, r) for r in range(cp)])
    out = torch.cat(parts, dim)
    return out.index_select(dim, torch.argsort(order).to(out.device))


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-token document ids [b, s] of packed windows ``tokens`` [b, s] (inputs): an EOS token opens the next
    document, being the context its first token is predicted from (as a BOS would be), so no prediction sees
    another document's tokens."""
    return torch.cumsum((tokens == eos_id).to(torch.int32), dim=1)


# -- masks and merging of blocks (each block is computed by modelpar_kernels.block_attention) ----------------


def _visible(q_pos, k_pos, q_doc, k_doc, window: int = 0) -> torch.Tensor:
    """Boolean [b or 1, 1, sq, sk]: key visible to query (earlier or same position, less than ``window`` back
    if one is given, same document)."""
    keep = k_pos[None, :] <= q_pos[:, None]
    if window:
        keep = keep & (q_pos[:, None] - k_pos[None, :] < window)
    keep = keep[None, None]
    if q_doc is not None:
        keep = keep & (k_doc[:, None, None, :] == q_doc[:, None, :, None])
    return keep


def merge_partial(out, lse, part_out, part_lse):
    """Merge a partial attention (``part_out`` [b, h, n, d], ``part_lse`` [b, h, n]) into the running (fp32)
    ``out``, ``lse`` of the same rows; returns the merged pair. A partial row with lse -inf adds nothing."""
    new_lse = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isinf(new_lse), 0.0, new_lse)
    merged = out * torch.exp(lse - safe)[..., None] + part_out.to(out.dtype) * torch.exp(part_lse - safe)[..., None]
    return merged, new_lse


# -- the ring -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Block:
    """Which local query rows meet which rows of the visiting K/V block, and how they are masked."""

    rows: slice
    cols: slice
    causal: bool


def _ring_block(rank: int, source: int, local: int) -> _Block:
    """The part of (queries of ``rank``) x (K/V of ``source``) that the causal mask leaves (balanced split)."""
    half = local // 2
    if source == rank:
        return _Block(slice(0, local), slice(0, local), True)  # both chunks in order: plain causal
    if source < rank:
        return _Block(slice(0, local), slice(0, half), False)  # its early chunk, seen by every local query
    return _Block(slice(half, local), slice(0, local), False)  # only the local late chunk sees it, all of it


def _window_pairs(rank: int, source: int, local: int, cp: int, window: int) -> list[tuple[_Block, int]]:
    """Under a window: the chunk pairs of (queries of ``rank``) x (K/V of ``source``) that some query sees some
    key of, each with its offset (first query position minus first key position); a pair wholly after its
    queries or wholly outside the window is left out."""
    c = local // 2
    q_chunks, k_chunks = (rank, 2 * cp - 1 - rank), (source, 2 * cp - 1 - source)
    pairs = []
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            offset = (qc - kc) * c
            if kc > qc or offset - (c - 1) >= window:  # after every query, or before every query's window
                continue
            pairs.append((_Block(slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), kc == qc), offset))
    return pairs


class _Blocks:
    """This cp rank's queries against the K/V of every cp rank, one source block at a time (ring and all-gather
    share it): the forward's running (out, lse) merge, and each block's share of the backward."""

    def __init__(self, q, cp, documents, backend, window=0, value_dim: int | None = None, softcap: float = 0.0):
        self.q, self.cp, self.documents, self.backend, self.window = q, cp, documents, backend, window
        self.softcap = softcap
        b, hq, self.local, d = q.shape
        self.positions = [local_positions(self.local * cp.size, cp.size, r, q.device) for r in range(cp.size)]
        self.acc = accumulation_dtype(q.dtype)
        # the output has the values' head dim (latent attention's differs from the queries')
        self.out = torch.zeros((b, hq, self.local, value_dim or d), dtype=self.acc, device=q.device)
        self.lse = torch.full((b, hq, self.local), float("-inf"), dtype=self.acc, device=q.device)

    def _masked(self, source: int):
        blocks = _blocks_and_masks(
            self.cp.rank, source, self.local, self.positions, self.documents, self.backend, self.window
        )
        return [(blk, replace(mask, softcap=self.softcap)) for blk, mask in blocks] if self.softcap else blocks

    def add_sinks(self, sinks: torch.Tensor | None) -> None:
        """Merge the sinks [hq] as one more block: a key every query sees with score ``sinks[h]`` and value 0."""
        if sinks is not None:
            sink_lse = sinks.to(self.acc)[None, :, None].expand_as(self.lse)
            self.out, self.lse = merge_partial(self.out, self.lse, torch.zeros_like(self.out), sink_lse)

    def forward(self, source: int, kv) -> None:
        """Merge the block(s) of ``source``'s K/V (kv: [2, b, hkv, L, d], or a pair k, v whose head dims differ)
        into the running output."""
        for blk, mask in self._masked(source):
            rows = blk.rows
            part_out, part_lse = block_attention_forward(
                self.q[:, :, rows], kv[0][:, :, blk.cols], kv[1][:, :, blk.cols], mask, self.backend
            )
            self.out[:, :, rows], self.lse[:, :, rows] = merge_partial(
                self.out[:, :, rows], self.lse[:, :, rows], part_out, part_lse
            )

    def backward(self, source, kv, dout, out, lse, dq, dkv) -> None:
        """Add the block's dq into ``dq`` and its dK/dV into ``dkv`` [2, b, hkv, L, d] (or a pair, as ``kv``);
        ``out``, ``lse``: the merged forward's."""
        for blk, mask in self._masked(source):
            rows = blk.rows
            dq_blk, dk_blk, dv_blk = block_attention_backward(
                dout[:, :, rows].contiguous(),
                self.q[:, :, rows].contiguous(),
                kv[0][:, :, blk.cols].contiguous(),
                kv[1][:, :, blk.cols].contiguous(),
                out[:, :, rows].contiguous(),
                lse[:, :, rows].contiguous(),
                mask,
                self.backend,
            )
            dq[:, :, rows] += dq_blk.to(dq.dtype)
            dkv[0][:, :, blk.cols] += dk_blk.to(dkv[0].dtype)
            dkv[1][:, :, blk.cols] += dv_blk.to(dkv[1].dtype)


def _save(ctx, q, k, v, out, lse, documents, cp, backend, window, softcap, sinks):
    ctx.cp, ctx.tag, ctx.backend, ctx.has_documents = cp, current_tag(), backend, documents is not None
    ctx.window, ctx.softcap, ctx.has_sinks = window, softcap, sinks is not None
    empty = torch.empty(0)
    ctx.save_for_backward(
        q, k, v, out, lse, documents if documents is not None else empty, sinks if sinks is not None else empty
    )


def _saved(ctx):
    """(q, k, v, out, lse, documents or None, sinks or None): ``saved_tensors`` read once (recompute allows one
    unpack)."""
    q, k, v, out, lse, documents, sinks = ctx.saved_tensors
    return q, k, v, out, lse, documents if ctx.has_documents else None, sinks if ctx.has_sinks else None


def _sinks_grad(sinks, dout, out, lse):
    """d loss / d sinks [hq]: each row's sink column has probability exp(sink - lse) and value 0, so its score's
    gradient is ``-p_sink * rowsum(dout * out)`` (FlashAttention's D), summed over batch and rows."""
    if sinks is None:
        return None
    d = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    p_sink = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)
    return (-(p_sink * d)).sum((0, 2)).to(sinks.dtype)


class _RingAttention(torch.autograd.Function):
    """q [b, hq, L, d], k, v [b, hkv, L, d] of this cp rank (L = s/cp) -> out [b, hq, L, d]."""

    @staticmethod
    def forward(ctx, q, k, v, cp, documents, backend, window, softcap, sinks):
        def ring():
            blocks = _Blocks(q, cp, documents, backend, window, softcap=softcap)
            kv = torch.stack([k, v]).contiguous()  # [2, b, hkv, L, d]: what travels
            for step in range(cp.size):
                pending = _pass_on(kv, cp) if step < cp.size - 1 else None  # overlapped with this block
                blocks.forward((cp.rank - step) % cp.size, kv)
                if pending is not None:
                    kv = pending.wait()
            blocks.add_sinks(sinks)
            return blocks.out.to(q.dtype), blocks.lse

        out, lse = kept_result(ring)  # under selective recompute: kept whole, not rerun
        _save(ctx, q, k, v, out, lse, documents, cp, backend, window, softcap, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, documents, sinks = _saved(ctx)
        cp = ctx.cp
        blocks = _Blocks(q, cp, documents, ctx.backend, ctx.window, softcap=ctx.softcap)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=blocks.acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        arriving = None  # the dK/dV partial sums of the visiting block, from the previous rank
        with comm_tag(ctx.tag):
            for step in range(cp.size):
                pending = _pass_on(kv, cp) if step < cp.size - 1 else None
                dkv = torch.zeros(kv.shape, dtype=blocks.acc, device=q.device)
                blocks.backward((cp.rank - step) % cp.size, kv, dout, out, lse, dq, dkv)
                if arriving is not None:
                    dkv += arriving.wait()
                # onwards with the K/V they belong to; after the last step each rank receives its own
                arriving = _pass_on(dkv, cp)
                if pending is not None:
                    kv = pending.wait()
            dkv = arriving.wait()
        sinks = _sinks_grad(sinks, dout, out, lse)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, sinks


class _AllGatherAttention(torch.autograd.Function):
    """q [b, hq, L, d], k, v [b, hkv, L, d] -> out: K/V of every cp rank gathered up front (kv heads only), the
    same blocks as the ring computed on them; backward reduce-scatters the gathered dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, cp, documents, backend, window, softcap, sinks):
        def gather_and_attend():
            blocks = _Blocks(q, cp, documents, backend, window, softcap=softcap)
            gathered = all_gather(torch.stack([k, v]).unsqueeze(0), cp.group)  # [cp, 2, b, hkv, L, d]
            for source in range(cp.size):
                blocks.forward(source, gathered[source])
            blocks.add_sinks(sinks)
            return blocks.out.to(q.dtype), blocks.lse

        out, lse = kept_result(gather_and_attend)  # under selective recompute: kept whole, not rerun
        _save(ctx, q, k, v, out, lse, documents, cp, backend, window, softcap, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, documents, sinks = _saved(ctx)
        cp = ctx.cp
        blocks = _Blocks(q, cp, documents, ctx.backend, ctx.window, softcap=ctx.softcap)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=blocks.acc, device=q.device)
        with comm_tag(ctx.tag):
            gathered = all_gather(torch.stack([k, v]).unsqueeze(0), cp.group)  # again: not kept from forward
            dkv = torch.zeros(gathered.shape, dtype=blocks.acc, device=q.device)
            for source in range(cp.size):
                blocks.backward(source, gathered[source], dout, out, lse, dq, dkv[source])
            mine = reduce_scatter(dkv, cp.group)[0]  # [2, b, hkv, L, d]
        sinks = _sinks_grad(sinks, dout, out, lse)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None, None, sinks


def _blocks_and_masks(rank, source, local, positions, documents, backend, window=0):
    """The blocks of (this rank's queries) x (``source``'s K/V) to compute, each with its mask: one block
    (``_ring_block``) without a window, its chunk pairs that meet the window with one (``_window_pairs``). A
    block no query of which sees any of its keys (documents that do not meet) is left out. Deciding that reads
    the device: on an accelerator no block is left out for documents (the step keeps its one host sync) and
    the kernel's mask gives such a block's rows lse -inf, which merges as nothing; the window's pairs are
    decided from positions alone."""
    if window:
        cp = len(positions)
        blocks = _window_pairs(rank, source, local, cp, window)
    else:
        blocks = [(_ring_block(rank, source, local), 0)]
    chosen = []
    for blk, offset in blocks:
        if documents is None and (backend == "triton" or not window):
            chosen.append((blk, BlockMask(blk.causal, window=window, offset=offset)))
            continue
        q_pos, k_pos = positions[rank][blk.rows], positions[source][blk.cols]
        if documents is None:  # the torch paths take the window as a boolean mask
            chosen.append((blk, BlockMask(blk.causal, keep=_visible(q_pos, k_pos, None, None, window))))
            continue
        q_docs, k_docs = documents[:, q_pos], documents[:, k_pos]
        decide = documents.device.type == "cpu" and not blk.causal  # the diagonal block always has its own tokens
        if backend == "triton":
            meet = not decide or any(bool(torch.isin(qd, kd).any()) for qd, kd in zip(q_docs, k_docs, strict=True))
            if meet:
                chosen.append((blk, BlockMask(blk.causal, q_docs=q_docs, k_docs=k_docs, window=window, offset=offset)))
            continue
        keep = _visible(q_pos, k_pos, q_docs, k_docs, window)
        if not decide or bool(keep.any()):
            chosen.append((blk, BlockMask(blk.causal, keep=keep)))
    return chosen


class _Transfer:
    """One ring transfer in flight: ``wait()`` returns the tensor received from the previous rank."""

    def __init__(self, tensor: torch.Tensor, cp: ContextParallelGroup):
        self.received = torch.empty_like(tensor)
        self.sent = tensor  # kept alive until the transfer completes
        self.cp = cp
        nxt, prev = cp.ranks[(cp.rank + 1) % cp.size], cp.ranks[(cp.rank - 1) % cp.size]
        self.works = send_recv(tensor, self.received, nxt, prev, cp.group)

    def wait(self) -> torch.Tensor:
        with blocking("send_recv", self.cp.group):
            for work in self.works:
                work.wait()
        return self.received


def _pass_on(tensor: torch.Tensor, cp: ContextParallelGroup) -> _Transfer:
    return _Transfer(tensor, cp)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallelGroup,
    documents: torch.Tensor | None = None,
    backend: str = "torch",
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this cp rank's queries over the whole sequence.

    q: [b, s/cp, hq, d]; k, v: [b, s/cp, hkv, d] (this rank's two chunks, see ``split_for_context``);
    ``documents``: None, or document ids [b, s] of the whole sequence (a query sees only its own document).
    ``window`` W > 0: a query at global position i sees positions ``i-W+1 .. i`` only. Returns [b, s/cp, hq, dv]
    (v's head dim). With cp size 1 this is plain (document-, window-)causal attention. ``backend`` "triton": the
    flash kernel computes every block. ``softcap`` c > 0: scores capped by ``c * tanh(s / c)`` inside each block
    before it enters the online softmax, on the torch path (the flash kernel has no cap). ``sinks`` [hq]: one
    learned logit per head in every row's softmax (a key of value 0 every query sees), merged into the online
    softmax as one more block (under the all-to-all, the sinks of the heads each rank holds after the exchange).
    """
    if softcap or sinks is not None:
        backend = "torch"
    if cp.a2a_size > 1:  # heads exchanged, then the ring (if any) across the all-to-all groups
        q, k, v = exchange_qkv(q, k, v, cp.a2a_group, cp.a2a_size)
        if sinks is not None:  # the heads this rank now holds: block (its place in the all-to-all group) of them
            per = sinks.shape[0] // cp.a2a_size
            sinks = sinks[(cp.rank % cp.a2a_size) * per :][:per]
        out = context_parallel_attention(q, k, v, cp.ring(), documents, backend, window, softcap, sinks)
        return sequence_from_heads(out, cp.a2a_group, cp.a2a_size)
    if cp.size == 1 and backend == "triton":
        return attention(q, k, v, True, backend="triton", documents=documents, window=window)
    q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    if cp.size == 1:
        out = _local_attention(q, k, v, documents, window, softcap, sinks)
    else:
        function = _RingAttention if cp.comm == "ring" else _AllGatherAttention
        out = function.apply(q, k, v, cp, documents, backend, window, softcap, sinks)
    return rearrange(out, "b h s d -> b s h d")


def _local_attention(q, k, v, documents, window=0, softcap=0.0, sinks=None):
    keep = None
    if documents is not None or window or softcap or sinks is not None:
        pos = torch.arange(q.shape[2], device=q.device)
        keep = _visible(pos, pos, documents, documents, window)
    if softcap or sinks is not None:  # plain matmuls, autograd's backward
        q, k, v = (rearrange(t, "b h s d -> b s h d") for t in (q, k, v))
        out = attention_math_reference(q, k, v, keep, softcap, sinks)
        return rearrange(out, "b s h d -> b h s d")
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, is_causal=keep is None, enable_gqa=q.shape[1] != k.shape[1]
    )


__all__ = [
    "CP_COMMS",
    "ContextParallelGroup",
    "context_parallel_attention",
    "document_ids",
    "local_positions",
    "merge_from_context",
    "split_for_context",
]
