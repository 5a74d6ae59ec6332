"""ZeRO stage 1: AdamW whose state and fp32 master weights are sharded over the data-parallel ranks.

Every parameter is laid end to end in one fp32 buffer, padded to a multiple of dp; rank r owns the slice
``[r*S, (r+1)*S)`` and keeps Adam moments for that slice only::

    flat:    | w0 .......... | w1 ...... | w2 ............. |pad|
    shards:  |    rank 0    |    rank 1   |    rank 2   | rank 3|

One step: reduce-scatter the gradients (sum / dp: each rank gets its slice of the global-batch mean), AdamW
on the slice, all-gather the updated slices into every rank's parameters. The result equals unsharded AdamW
after a DP all-reduce, to fp32 round-off, at 1/dp of the optimizer memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from modelpar.optim.adamw import make_adamw
from modelpar.optim.param_info import ParamInfo, ParamsWithInfo, check_same_across, check_unique
from modelpar.parallel import collectives


@dataclass(frozen=True)
class _Segment:
    """The part of parameter ``index`` inside this rank's shard: flat positions ``[start, end)``.

    ``param_start`` is where the whole parameter begins in the flat buffer, so the segment is
    ``param.view(-1)[start - param_start : end - param_start]``.
    """

    index: int
    start: int
    end: int
    param_start: int


class ZeroOneAdamW:
    """AdamW sharded over ``dp_group`` (ZeRO-1). Replaces both ``GradientSynchronizer`` and ``build_adamw``.

    Per step, after all micro-batches' backward (``param.grad`` holds this rank's local mean)::

        opt.reduce_gradients()
        norm = clip_grad_norm(opt.shard_params_with_info(), max_norm, groups, zero_sharded=True)
        set_lr(opt, lr_at(step, ...)); opt.step(); opt.zero_grad()

    The fp32 master copy of the shard is taken from the model at the first ``step()`` (or restored from a
    checkpoint by ``load_optimizer_state_tensors``), so weights may be loaded into the model after construction.
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
    ):
        if not params_with_info:
            raise ValueError("ZeroOneAdamW needs at least one parameter")
        self.params = [p for p, _ in params_with_info]
        self.infos = [info for _, info in params_with_info]
        check_unique(self.params)
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        check_same_across(self.params, dp_group)
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.shard_numel = -(-self.numel // self.dp_size)
        self.shard_start = dist.get_rank(dp_group) * self.shard_numel
        device = self.params[0].device
        self.master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)  # [S]
        self.segments = self._segments_in_shard()
        self._views = [self.master[self._local(seg)] for seg in self.segments]
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
        )
        self._master_ready = False

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
        device = self.master.device
        flat = torch.zeros(self.shard_numel * self.dp_size, dtype=torch.float32, device=device)  # [dp*S]
        for i, p in enumerate(self.params):
            if p.grad is not None:
                flat[self.offsets[i] : self.offsets[i + 1]].copy_(p.grad.reshape(-1))
        has_grad = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32, device=device)
        if self.dp_size > 1:
            shard = collectives.reduce_scatter(flat, self.dp_group).div_(self.dp_size)  # [S]
            collectives.all_reduce(has_grad, self.dp_group)
        else:
            shard = flat
        self._shard, self.has_grad = shard, has_grad
        if read_back:
            self.apply_has_grad(has_grad.tolist())
        else:
            for seg, view in zip(self.segments, self._views, strict=True):
                view.grad = shard[self._local(seg)]  # a zero gradient adds nothing to the norm nor to clipping

    def apply_has_grad(self, any_grad: list[float]) -> None:
        """Keep the shard gradient of each parameter some dp rank gave one (``any_grad[i]``), else ``None``."""
        for seg, view in zip(self.segments, self._views, strict=True):
            view.grad = self._shard[self._local(seg)] if any_grad[seg.index] else None

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
        per_element = info.norm_share.repeat_interleave(param[0].numel()).to(self.master.device)
        return replace(info, norm_share=per_element[seg.start - seg.param_start : seg.end - seg.param_start])

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the shard, then all-gather the shards into every rank's model parameters."""
        self._ensure_master()
        self.shard_optimizer.step()
        full = collectives.all_gather(self.master, self.dp_group) if self.dp_size > 1 else self.master  # [dp*S]
        for i, p in enumerate(self.params):
            p.copy_(full[self.offsets[i] : self.offsets[i + 1]].view_as(p))

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
        states = [self.shard_optimizer.state.get(view) for view in self._views]
        stepped = torch.tensor([float(any(states))], device=self.master.device)
        step = torch.tensor([max((float(st["step"]) for st in states if st), default=0.0)], device=self.master.device)
        if self.dp_size > 1:
            collectives.all_reduce(stepped, self.dp_group, op=dist.ReduceOp.MAX)
            collectives.all_reduce(step, self.dp_group, op=dist.ReduceOp.MAX)
        if not stepped.item():
            return None
        out: list[dict] = [{} for _ in self.params]
        for kind in kinds:
            flat = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.master.device)
            for seg, state in zip(self.segments, states, strict=True):
                if state:
                    flat[self._local(seg)] = state[kind]
            full = collectives.all_gather(flat, self.dp_group) if self.dp_size > 1 else flat  # [dp*S]
            for i, p in enumerate(self.params):
                out[i][kind] = full[self.offsets[i] : self.offsets[i + 1]].view_as(p)
        return out, step.item()

    @torch.no_grad()
    def load_master(self, values: list[torch.Tensor | None]) -> None:
        """Set each segment's fp32 master weights (in ``named_segments`` order); ``None`` takes the model's."""
        self._master_ready = False
        self._ensure_master()
        for view, value in zip(self._views, values, strict=True):
            if value is not None:
                view.copy_(value)

    def _segments_in_shard(self) -> list[_Segment]:
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        segments = []
        for i in range(len(self.params)):
            start, end = max(lo, self.offsets[i]), min(hi, self.offsets[i + 1])
            if start < end:
                segments.append(_Segment(index=i, start=start, end=end, param_start=self.offsets[i]))
        return segments

    def _local(self, seg: _Segment) -> slice:
        return slice(seg.start - self.shard_start, seg.end - self.shard_start)

    @torch.no_grad()
    def _ensure_master(self) -> None:
        if self._master_ready:
            return
        for seg, view in zip(self.segments, self._views, strict=True):
            whole = self.params[seg.index].detach().reshape(-1)
            view.copy_(whole[seg.start - seg.param_start : seg.end - seg.param_start])
        self._master_ready = True
