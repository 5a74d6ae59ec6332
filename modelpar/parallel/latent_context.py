"""Context parallelism for multi-head latent attention: the per-token latent travels, each rank re-expands it.

Latent attention (``modelpar.model.layers.latent_attention``) builds every head's key and value from one latent
per token, ``[c_kv | k_pe]`` of ``kv_lora_rank + qk_rope_head_dim`` elements (c_kv RMSNormed, k_pe already
rotated at its token's global position), shared by the heads. That latent is what crosses the cp group, in the
ring (``parallel.cp_comm=ring``) or gathered up front (``allgather``), with the same load-balanced blocks and
lse merge as ``modelpar.parallel.context``; each rank expands every block it meets with ``kv_b_proj`` (its own
tp shard of heads) before attending to it::

    per token and layer, one exchange:   latent  kv_lora_rank + qk_rope_head_dim   (every tp rank the same)
                                         expanded  heads/t * (qk_nope + qk_rope + v_head_dim)

DeepSeek-V3 (512 + 64 against 128 heads x (128 + 64 + 128)) sends 71x fewer elements at tp=1 and 8.9x fewer at
tp=8, for cp x the kv_b_proj FLOPs (each rank expands the whole sequence's latent, forward and again in
backward). Backward recomputes each block's expansion, takes its dK/dV through ``kv_b_proj``'s backward and
passes the latent's gradient (the same size as the latent, fp32) around the ring with it, or reduce-scatters
it (all-gather); the ``kv_b_proj`` weight gradient of this rank's queries accumulates here, reduced over
dp x cp with every other weight's.

``alltoall`` / ``hybrid`` (Ulysses) exchange heads, which the latent does not have: refused for latent attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from modelpar.parallel.collectives import all_gather, comm_tag, current_tag, reduce_scatter
from modelpar.parallel.context import ContextParallelGroup, _Blocks, _pass_on

# (latent [b, L, c], kv_b_proj weight) -> k [b, n, L, dk], v [b, n, L, dv]: the expansion of one block
Expand = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _LatentAttention(torch.autograd.Function):
    """q [b, n, L, dk] and latent [b, L, c] of this cp rank, ``weight`` the expansion's -> out [b, n, L, dv]."""

    @staticmethod
    def forward(ctx, q, latent, weight, expand, value_dim, cp, documents, backend):
        blocks = _Blocks(q, cp, documents, backend, value_dim=value_dim)
        latent = latent.contiguous()
        if cp.comm == "ring":
            block = latent
            for step in range(cp.size):
                pending = _pass_on(block, cp) if step < cp.size - 1 else None  # overlapped with this block
                blocks.forward((cp.rank - step) % cp.size, expand(block, weight))
                if pending is not None:
                    block = pending.wait()
        else:
            gathered = all_gather(latent.unsqueeze(0), cp.group)  # [cp, b, L, c]
            for source in range(cp.size):
                blocks.forward(source, expand(gathered[source], weight))
        out = blocks.out.to(q.dtype)
        ctx.cp, ctx.tag, ctx.backend, ctx.expand, ctx.value_dim = cp, current_tag(), backend, expand, value_dim
        ctx.has_documents = documents is not None
        ctx.save_for_backward(
            q, latent, weight, out, blocks.lse, documents if documents is not None else q.new_empty(0)
        )
        return out

    @staticmethod
    def backward(ctx, dout):
        q, latent, weight, out, lse, documents = ctx.saved_tensors
        cp = ctx.cp
        blocks = _Blocks(q, cp, documents if ctx.has_documents else None, ctx.backend, value_dim=ctx.value_dim)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=blocks.acc, device=q.device)
        dweight = torch.zeros(weight.shape, dtype=blocks.acc, device=weight.device)

        def block_grad(source: int, block: torch.Tensor) -> torch.Tensor:
            """The gradient of ``source``'s latent from this rank's queries; adds its kv_b_proj share."""
            with torch.enable_grad():
                block_in, weight_in = block.detach().requires_grad_(), weight.detach().requires_grad_()
                k, v = ctx.expand(block_in, weight_in)
            dk = torch.zeros(k.shape, dtype=blocks.acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=blocks.acc, device=v.device)
            blocks.backward(source, (k.detach(), v.detach()), dout, out, lse, dq, (dk, dv))
            dblock, dw = torch.autograd.grad((k, v), (block_in, weight_in), (dk.to(k.dtype), dv.to(v.dtype)))
            dweight.add_(dw)
            return dblock.to(blocks.acc)

        with comm_tag(ctx.tag):
            if cp.comm == "ring":
                block, arriving = latent, None
                for step in range(cp.size):
                    pending = _pass_on(block, cp) if step < cp.size - 1 else None
                    dblock = block_grad((cp.rank - step) % cp.size, block)
                    if arriving is not None:
                        dblock += arriving.wait()
                    arriving = _pass_on(dblock, cp)  # onwards with its latent; at the end each rank gets its own
                    if pending is not None:
                        block = pending.wait()
                dlatent = arriving.wait()
            else:
                gathered = all_gather(latent.unsqueeze(0), cp.group)  # again: not kept from forward
                dgathered = torch.stack([block_grad(source, gathered[source]) for source in range(cp.size)])
                dlatent = reduce_scatter(dgathered, cp.group)[0]
        return dq.to(q.dtype), dlatent.to(latent.dtype), dweight.to(weight.dtype), None, None, None, None, None


def latent_context_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    weight: torch.Tensor,
    expand: Expand,
    value_dim: int,
    cp: ContextParallelGroup,
    documents: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Causal attention of this cp rank's queries q [b, n, s/cp, dk] over the whole sequence, whose keys and
    values are ``expand(latent block, weight)`` of every cp rank's latent [b, s/cp, c] (this rank's two
    chunks, see ``modelpar.parallel.context.split_for_context``). ``documents``: None, or document ids [b, s]
    of the whole sequence. Returns [b, n, s/cp, value_dim]."""
    if cp.a2a_size > 1:
        raise ValueError(
            f"parallel.cp_comm={cp.comm} exchanges heads, which latent attention's shared latent has none of; "
            "use parallel.cp_comm=ring or allgather"
        )
    return _LatentAttention.apply(q, latent, weight, expand, value_dim, cp, documents, backend)


__all__ = ["Expand", "latent_context_attention"]
