"""QK-clip (Kimi K2's MuonClip): after each update, rescale the query and key projections of every attention
head whose largest logit of the step exceeded ``optim.qk_clip`` (tau), so that it would be tau.

Every attention layer tracks each local query head's largest logit over the step's training forwards
(``modelpar.model.layers.logit_max``: over the micro-batches, and the keys of every cp rank). After the
optimizer step the maxima are reduced (max over dp x cp), gathered over tp into one vector per layer of every
head (so each rank sees each head's value whatever tp holds), and for head h with ``S_h > tau``,
``gamma_h = tau / S_h``. With grouped-query attention a key head serves several query heads, so one factor
cannot serve each of them as the report's sqrt(gamma_h) on both sides does; instead, for key head g with query
heads H_g, ``gamma_g = min over H_g of gamma_h``: its ``k_proj`` rows are scaled by ``sqrt(gamma_g)`` and
each query head's ``q_proj`` rows by ``gamma_h / sqrt(gamma_g)``. Every logit of head h then scales by exactly
``gamma_h`` (multi-head attention: ``sqrt(gamma_h)`` on both sides, the report's rule). Heads under tau are
untouched.

Multi-head latent attention, as the K2 report does: each head's key is its own part k_C (from ``kv_b_proj``)
and a rotary part k_R shared by every head; q_C (the no-position part of q) and k_C are scaled by
``sqrt(gamma_h)``, q_R (q's rotary part) by ``gamma_h``, and the shared k_R is left alone: every logit
``q_C k_C + q_R k_R`` of head h scales by ``gamma_h``.

Under ZeRO-1 the rows are rescaled in the fp32 master segments too (the next step gathers the weights from
them); under ZeRO-2/3 each rank rescales the rows of its dp shard. Not combined (refused by the recipe
check): ``model.qk_norm`` (the norms undo a scale of the projections).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from modelpar.model.layers.attention import ParallelAttention
from modelpar.model.layers.latent_attention import LatentAttention
from modelpar.optim import DataParallelOptimizer, ZeroOneAdamW
from modelpar.optim.fsdp import dp_rows, local
from modelpar.parallel import collectives
from modelpar.parallel.groups import ParallelGroups
from modelpar.training.plugins import StepPlugin


class QKClip(StepPlugin):
    """The step plug-in (``optim.qk_clip`` > 0): arms the trackers at ``begin``, clips at ``after_update``.
    ``last_max``: per layer of this rank, every head's largest logit of the last step (before clipping)."""

    name = "qk_clip"

    def __init__(self, chunks, groups: ParallelGroups, threshold: float, optimizer: DataParallelOptimizer):
        kinds = (ParallelAttention, LatentAttention)
        self.layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, kinds)]
        self.groups, self.threshold = groups, threshold
        self.last_max: list[torch.Tensor] = []
        self.masters: dict[int, list] = {}  # ZeRO-1: each parameter's master segments, rescaled with it
        zero = optimizer.optimizer
        if isinstance(zero, ZeroOneAdamW):
            for seg, view in zip(zero.segments, zero._views, strict=True):
                self.masters.setdefault(id(zero.params[seg.index]), []).append((view, *seg.within_param))

    def begin(self, step: int) -> None:
        for m in self.layers:
            m.max_logits = torch.full((m.heads,), float("-inf"), device=m.o_proj.weight.device)

    def after_update(self, step: int, applied: bool) -> None:
        if not self.layers:
            return
        self.last_max = self._global_maxima()
        if applied:
            for m, maxima in zip(self.layers, self.last_max, strict=True):
                _clip(m, maxima, self.threshold, self.masters)

    def _global_maxima(self) -> list[torch.Tensor]:
        """Each layer's [heads] largest logits over the whole step: max over dp x cp, gathered over tp."""
        local = torch.cat([m.max_logits for m in self.layers])
        g = self.groups
        with collectives.comm_tag("qk_clip"):
            if len(g.dp_cp_ranks) > 1:
                collectives.all_reduce(local, g.dp_cp_group, op=dist.ReduceOp.MAX)
            tp = len(g.tp_ranks)
            every = collectives.all_gather(local, g.tp_group).view(tp, -1) if tp > 1 else local.view(1, -1)
        out, start = [], 0
        for m in self.layers:  # rank r holds heads r * heads .. (r + 1) * heads: rank-major is head order
            out.append(every[:, start : start + m.heads].reshape(-1))
            start += m.heads
        return out


@torch.no_grad()
def _clip(m: ParallelAttention | LatentAttention, maxima: torch.Tensor, threshold: float, masters=None) -> None:
    """Rescale ``m``'s local q and k rows from every head's largest logit (the module docstring's rule): in the
    model's parameters (their dp shard under ZeRO-2/3) and in ZeRO-1's master segments (``masters``:
    ``id(param) -> [(segment, start, end)]``, flat positions in the parameter)."""
    if not bool((maxima > threshold).any()):
        return
    for param, scale in row_scales(m, torch.clamp(threshold / maxima, max=1.0)):
        scale = scale.to(param.device, param.dtype)
        local(param).mul_(scale[dp_rows(param)][:, None])
        for segment, start, end in (masters or {}).get(id(param), ()):
            segment.mul_(scale.repeat_interleave(param[0].numel())[start:end].to(segment.dtype))


def row_scales(m: ParallelAttention | LatentAttention, gamma: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, factor per row of its tp-local tensor)`` from every head's ``gamma`` (1: untouched)."""
    if isinstance(m, LatentAttention):  # q_C, k_C by sqrt(gamma), q_R by gamma, the shared k_R kept
        g = gamma[m.first_head : m.first_head + m.heads][:, None]
        n, dk, dn = m.heads, m.qk_dim, m.nope
        q = (m.q_b_proj if m.q_b_proj is not None else m.down_proj).weight  # q_proj's rows lead the down_proj
        q_scale = torch.ones(q.shape[0])
        q_scale[: n * dk].view(n, dk)[:, :dn] = g.sqrt()
        q_scale[: n * dk].view(n, dk)[:, dn:] = g
        kv_scale = torch.ones(n, dn + m.value_dim)
        kv_scale[:, :dn] = g.sqrt()
        return [(q, q_scale), (m.kv_b_proj.weight, kv_scale.reshape(-1))]
    per_kv = m.total_heads // m.total_kv_heads
    gamma_kv = gamma.view(m.total_kv_heads, per_kv).amin(dim=1)  # [kv heads]
    q_scale = gamma / gamma_kv.repeat_interleave(per_kv).sqrt()
    d, w = m.head_dim, m.qkv_proj.weight
    scale = torch.ones(w.shape[0])
    q_rows, k_rows = m.heads * d, m.kv_heads * d
    scale[:q_rows] = q_scale[m.first_head : m.first_head + m.heads].repeat_interleave(d)
    scale[q_rows : q_rows + k_rows] = (
        gamma_kv[m.first_kv_head : m.first_kv_head + m.kv_heads].sqrt().repeat_interleave(d)
    )
    return [(w, scale)]


__all__ = ["QKClip"]
