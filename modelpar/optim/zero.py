"""ZeRO stage 1: AdamW whose state and fp32 master weights are sharded over the data-parallel ranks.

Every parameter is laid end to end in one fp32 buffer, padded to a multiple of dp; rank r owns the slice
``[r*S, (r+1)*S)`` and keeps Adam moments for that slice only::

    flat:    | w0 .......... | w1 ...... | w2 ............. |pad|
    shards:  |    rank 0    |    rank 1   |    rank 2   | rank 3|

One step: reduce-scatter the gradients (sum / dp: each rank gets its slice of the global-batch mean), AdamW
on the slice, all-gather the updated slices into every rank's parameters. The result equals unsharded AdamW
after a DP all-reduce, to fp32 round-off, at 1/dp of the optimizer memory.

A mixture of experts' expert weights differ between the ranks of an ep group, so they form a second such
buffer, sharded over the ranks holding the same experts (the expert data-parallel group, dp x cp / ep of
them) while their gradients are still averaged over all dp x cp ranks' tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from modelpar.optim.adamw import make_adamw
from modelpar.optim.muon_adamw import muon_piece
from modelpar.optim.muon_layout import MuonLayout
from modelpar.optim.param_info import ParamInfo, ParamsWithInfo, check_same_across, check_unique
from modelpar.parallel import collectives


@dataclass(frozen=True)
class _Segment:
    """The part of parameter ``index`` inside this rank's shard: flat positions ``[start, end)`` of its partition.

    ``param_start`` is where the whole parameter begins in the partition's flat buffer, so the segment is
    ``param.view(-1)[start - param_start : end - param_start]``; ``shard_start`` is where this rank's shard begins.
    """

    index: int
    start: int
    end: int
    param_start: int
    shard_start: int

    @property
    def within_param(self) -> tuple[int, int]:
        """The segment's flat positions in its parameter."""
        return self.start - self.param_start, self.end - self.param_start

    @property
    def local(self) -> slice:
        """The segment's place in the partition's master shard."""
        return slice(self.start - self.shard_start, self.end - self.shard_start)


@dataclass(eq=False)
class _Partition:
    """Parameters sharded over one group: laid end to end, padded to a multiple of the group's size.

    Dense parameters are sharded over dp (x cp); a mixture of experts' expert weights, which differ between
    the ranks of an ep group, over the ranks holding the same experts (the expert data-parallel group), with
    their gradients still averaged over every token of dp x cp (``divisor``).
    """

    indices: list[int]  # positions in ZeroOneAdamW.params
    offsets: list[int]  # start of each of them in the flat buffer; offsets[-1] is the total
    group: dist.ProcessGroup | None  # None: one rank holds the whole partition
    divisor: int  # the summed gradients are divided by this (the ranks whose tokens they cover)
    size: int = 1
    shard_numel: int = 0
    master: torch.Tensor | None = None  # [shard_numel] fp32
    segments: list[_Segment] | None = None

    @classmethod
    def build(cls, params: list[torch.Tensor], indices: list[int], group, divisor: int) -> _Partition:
        offsets = [0]
        for i in indices:
            offsets.append(offsets[-1] + params[i].numel())
        size = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        shard_numel = -(-offsets[-1] // size)
        lo, hi = rank * shard_numel, (rank + 1) * shard_numel
        segments = []
        for pos, i in enumerate(indices):
            start, end = max(lo, offsets[pos]), min(hi, offsets[pos + 1])
            if start < end:
                segments.append(_Segment(index=i, start=start, end=end, param_start=offsets[pos], shard_start=lo))
        master = torch.zeros(shard_numel, dtype=torch.float32, device=params[indices[0]].device)
        return cls(indices, offsets, group, divisor, size, shard_numel, master, segments)

    def flat_grads(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Every gradient of the partition end to end, zero where none, padded: ``[size * shard_numel]``."""
        flat = torch.zeros(self.shard_numel * self.size, dtype=torch.float32, device=self.master.device)
        for pos, i in enumerate(self.indices):
            if params[i].grad is not None:
                flat[self.offsets[pos] : self.offsets[pos + 1]].copy_(params[i].grad.reshape(-1))
        return flat

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[shard_numel]`` shard of the partition, end to end (collective over its group)."""
        return collectives.all_gather(shard, self.group) if self.size > 1 else shard


class ZeroOneAdamW:
    """AdamW sharded over ``dp_group`` (ZeRO-1). Replaces both ``GradientSynchronizer`` and ``build_adamw``.

    Per step, after all micro-batches' backward (``param.grad`` holds this rank's local mean)::

        opt.reduce_gradients()
        norm = clip_grad_norm(opt.shard_params_with_info(), max_norm, groups, zero_sharded=True)
        set_lr(opt, lr_at(step, ...)); opt.step(); opt.zero_grad()

    With ``expert_divisor`` set, the parameters whose info says ``expert_parallel`` form a second partition,
    sharded over ``expert_group`` (the ranks holding the same experts; None when that is this rank alone) and
    divided by ``expert_divisor`` (dp x cp). The fp32 master copy of the shard is taken from the model at the
    first ``step()`` (or restored from a checkpoint by ``load_optimizer_state_tensors``), so weights may be
    loaded into the model after construction.
    """

    def __init__(
        self,
        params_with_info: ParamsWithInfo,
        dp_group: dist.ProcessGroup,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        expert_group: dist.ProcessGroup | None = None,
        expert_divisor: int | None = None,
        muon_layout: MuonLayout | None = None,
    ):
        if not params_with_info:
            raise ValueError("ZeroOneAdamW needs at least one parameter")
        separate = expert_divisor is not None
        ordered = [pi for pi in params_with_info if not (separate and pi[1].expert_parallel)]
        ordered += [pi for pi in params_with_info if separate and pi[1].expert_parallel]
        self.params = [p for p, _ in ordered]
        self.infos = [info for _, info in ordered]
        check_unique(self.params)
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        dense = [i for i, info in enumerate(self.infos) if not (separate and info.expert_parallel)]
        experts = [i for i in range(len(self.params)) if i not in set(dense)]
        self.partitions = []
        for indices, group, divisor in ((dense, dp_group, self.dp_size), (experts, expert_group, expert_divisor)):
            if not indices:
                continue
            if group is not None:
                check_same_across([self.params[i] for i in indices], group)
            self.partitions.append(_Partition.build(self.params, indices, group, divisor))
        self.segments = [seg for part in self.partitions for seg in part.segments]
        self._views = [part.master[seg.local] for part in self.partitions for seg in part.segments]
        muon = None
        if muon_layout is not None:  # Muon's pieces: the segments of the parameters it covers
            pieces = {
                id(view): muon_piece(muon_layout, self.params[seg.index], flat=slice(*seg.within_param))
                for seg, view in zip(self.segments, self._views, strict=True)
                if muon_layout.is_muon(self.params[seg.index])
            }
            muon = (muon_layout, pieces)
        self.shard_optimizer = make_adamw(
            [
                (
                    view,
                    f"{self.infos[seg.index].name}[{seg.start - seg.param_start}:{seg.end - seg.param_start}]",
                    self.infos[seg.index].decay,
                )
                for seg, view in zip(self.segments, self._views, strict=True)
            ],
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            muon=muon,
        )
        self._master_ready = False

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's shard of the dense parameters."""
        return self.partitions[0].shard_numel

    @property
    def param_groups(self) -> list[dict]:
        """The shard optimizer's groups (decay, no decay): ``set_lr`` writes ``lr`` here."""
        return self.shard_optimizer.param_groups

    def reduce_gradients(self, read_back: bool = True) -> None:
        """Average ``param.grad`` over dp into this rank's shard (one reduce-scatter, one tiny all-reduce).

        A parameter that no rank gave a gradient keeps ``grad = None`` on its shard segments, so AdamW skips it
        exactly as it would unsharded. Knowing which reads a flag per parameter back to the host: with
        ``read_back=False`` every segment gets its (zero, where none) gradient now and the caller passes the
        flags of ``has_grad`` to ``apply_has_grad`` before ``step`` (folded into the step's one host sync).
        """
        shards, flags = [], []
        for part in self.partitions:
            flat = part.flat_grads(self.params)  # [size * S]
            has_grad = torch.tensor(
                [self.params[i].grad is not None for i in part.indices], dtype=torch.float32, device=flat.device
            )
            if part.size > 1:
                flat = collectives.reduce_scatter(flat, part.group)  # [S]
                collectives.all_reduce(has_grad, part.group)
            shards.append(flat.div_(part.divisor))
            flags.append(has_grad)
        self._shards, self.has_grad = shards, torch.cat(flags)
        if read_back:
            self.apply_has_grad(self.has_grad.tolist())
        else:
            for (shard, seg), view in zip(self._segment_shards(), self._views, strict=True):
                view.grad = shard[seg.local]  # a zero gradient adds nothing to the norm nor to clipping

    def _segment_shards(self) -> list[tuple[torch.Tensor, _Segment]]:
        """Each segment with its partition's reduced gradient shard (after ``reduce_gradients``)."""
        pairs = zip(self.partitions, self._shards, strict=True)
        return [(shard, seg) for part, shard in pairs for seg in part.segments]

    def apply_has_grad(self, any_grad: list[float]) -> None:
        """Keep the shard gradient of each parameter some dp rank gave one (``any_grad[i]``), else ``None``."""
        for (shard, seg), view in zip(self._segment_shards(), self._views, strict=True):
            view.grad = shard[seg.local] if any_grad[seg.index] else None

    def shard_params_with_info(self) -> list[tuple[torch.Tensor, ParamInfo]]:
        """This rank's shard segments (``.grad`` set by ``reduce_gradients``) with their parameter's info.

        Pass to ``clip_grad_norm(..., zero_sharded=True)``: each element lives in exactly one dp shard.
        """
        return [(view, self._segment_info(seg)) for seg, view in zip(self.segments, self._views, strict=True)]

    def _segment_info(self, seg: _Segment) -> ParamInfo:
        """The parameter's info, with per-row norm shares cut down to this segment's elements."""
        info = self.infos[seg.index]
        if not isinstance(info.norm_share, torch.Tensor):
            return info
        param = self.params[seg.index]
        per_element = info.norm_share.repeat_interleave(param[0].numel()).to(param.device)
        return replace(info, norm_share=per_element[seg.start - seg.param_start : seg.end - seg.param_start])

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the shard, then all-gather the shards into every rank's model parameters."""
        self._ensure_master()
        self.shard_optimizer.step()
        for part in self.partitions:
            full = part.gather(part.master)  # [size * S]
            for pos, i in enumerate(part.indices):
                self.params[i].copy_(full[part.offsets[pos] : part.offsets[pos + 1]].view_as(self.params[i]))

    def zero_grad(self) -> None:
        """Drop the model's and the shard's gradients (``None``, so the next backward starts fresh)."""
        for p in self.params:
            p.grad = None
        for view in self._views:
            view.grad = None

    def named_segments(self) -> list[tuple[str, int, int, torch.Tensor]]:
        """``(name, start, end, master)`` per segment: ``master: [end - start]`` is the fp32 master copy of
        ``param.view(-1)[start:end]``, the tensor the shard optimizer keys its state by."""
        self._ensure_master()
        return [
            (self.infos[seg.index].name, seg.start - seg.param_start, seg.end - seg.param_start, view)
            for seg, view in zip(self.segments, self._views, strict=True)
        ]

    @torch.no_grad()
    def full_moments(self, kinds: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> tuple[list[dict], float] | None:
        """Collective over dp: every parameter's whole Adam moments, ``[{kind: tensor shaped like the param}]``
        in parameter order, and the step count; None (on every rank) before the first step. For checkpoints
        that another layout can read: costs one all-gather of each moment, like the step's of the weights."""
        states = {id(view): self.shard_optimizer.state.get(view) for view in self._views}
        device = self.partitions[0].master.device
        stepped = torch.tensor([float(any(states.values()))], device=device)
        steps = (float(st["step"]) for st in states.values() if st and "step" in st)  # Muon's state has none
        step = torch.tensor([max(steps, default=0.0)], device=device)
        for part in self.partitions:  # a shard of padding only has no state: ask the other ranks
            if part.size > 1:
                collectives.all_reduce(stepped, part.group, op=dist.ReduceOp.MAX)
                collectives.all_reduce(step, part.group, op=dist.ReduceOp.MAX)
        if not stepped.item():
            return None
        out: list[dict] = [{} for _ in self.params]
        views = iter(self._views)
        part_views = [[next(views) for _ in part.segments] for part in self.partitions]
        for kind in kinds:
            for part, mine in zip(self.partitions, part_views, strict=True):
                flat = torch.zeros(part.shard_numel, dtype=torch.float32, device=device)
                for seg, view in zip(part.segments, mine, strict=True):
                    if states[id(view)] and kind in states[id(view)]:  # Adam's moments or Muon's buffer
                        flat[seg.local] = states[id(view)][kind]
                full = part.gather(flat)  # [size * S]
                for pos, i in enumerate(part.indices):
                    out[i][kind] = full[part.offsets[pos] : part.offsets[pos + 1]].view_as(self.params[i])
        return out, step.item()

    @torch.no_grad()
    def load_master(self, values: list[torch.Tensor | None]) -> None:
        """Set each segment's fp32 master weights (in ``named_segments`` order); ``None`` takes the model's."""
        self._master_ready = False
        self._ensure_master()
        for view, value in zip(self._views, values, strict=True):
            if value is not None:
                view.copy_(value)

    @torch.no_grad()
    def _ensure_master(self) -> None:
        if self._master_ready:
            return
        for seg, view in zip(self.segments, self._views, strict=True):
            whole = self.params[seg.index].detach().reshape(-1)
            view.copy_(whole[seg.start - seg.param_start : seg.end - seg.param_start])
        self._master_ready = True
