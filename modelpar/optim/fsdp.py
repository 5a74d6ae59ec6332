"""ZeRO-2 and ZeRO-3 on torch's FSDP2: the optimizer over parameters ``modelpar.model.parallelize.apply_fsdp``
sharded over dp x cp, block by block (a mixture of experts' experts over the ranks holding the same experts).

The optimizer never shards the model; it drives FSDP2's switches through a step. Gradients accumulate
unsharded over a step's micro-batches and are reduce-scattered (averaged over dp x cp) once, by the chunk's
last backward; with ``reduce_every_micro_batch`` every backward does (the memory mode: gradients are never
kept unsharded across micro-batches). At stage 3 a chunk's weights are freed after each backward; at stage 2
they stay gathered until the step reduces.

**Split backward (ZB-H1).** FSDP2's post-backward hook sits on each block's *input*, so it fires at the end
of B (``modelpar.pipeline.split_backward``), before W has produced a single weight gradient. Under a split
schedule, then, FSDP2's gradient sync stays off for every B and W, and the weights a B gathered stay
gathered until W (``set_reshard_after_backward(False)``): a weight gradient needs only the saved input and
the output gradient, but some backward nodes (tp's fused column matmul, the Triton RMSNorm, a full-recompute
rerun) read the weight too, and W reuses B's gathered copy (``before_weight_backward`` gathers again only if
a forward freed it in between). After the chunk's last W (``after_weight_backward``) the accumulated
unsharded gradients are reduce-scattered into the sharded ``.grad`` by FSDP2's own post-backward, called
once per parameter group as ``torch.distributed.pipelining`` does for its REDUCE_GRAD step (FSDP2 has no
public call for a reduction outside autograd's hooks), which also frees the gathered weights. The price at
stage 3: a chunk's weights stay gathered from a B to its W, instead of two blocks at a time.

``FullyShardedAdamW`` is the ``DataParallelOptimizer`` over such parameters: torch's AdamW on the sharded
parameters (fp32 masters and moments sharded with them), the global norm summed over the shards. The
checkpoint sees whole tp-local tensors: ``full_local`` gathers a parameter over dp for saving, and
``load_local`` writes a whole tp-local tensor into this rank's dp shard, so checkpoints and resharding are
those of every other stage. Sums over tp (sequence-parallel norm weights, kv heads replicated when
``kv_heads < tp``) run on the dp shards after the reduce-scatter (a sum over tp and a mean over dp commute):
each logical tensor's rows are mapped onto the rows of the dp shard (``ShardInfo.piece_of``). Parameters
without a gradient (a sigmoid router's balancing bias, moved by rule) are not sharded (``ignored_params``).

**Expert parallelism.** Experts sharded over the ranks holding the same experts are reduce-scattered and
divided by dp x cp by FSDP2 itself; experts no other rank holds stay whole, outside FSDP2, and the gradient
finalisation divides them (``modelpar.optim.finalize``). Either way every expert value lives on exactly one
rank of dp x cp, so the grad norm sums the dp x cp group once (no extra sum over ep); the checkpoint's
gathers and ``piece_of`` read each parameter's own mesh.

Not combined (refused in one line by the recipe check): the dp-replica outlier check and the
silent-corruption rerun (both need the gradients before they are reduced), and ``model.compile``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from modelpar.optim.adamw import build_adamw
from modelpar.optim.clip import clip_grad_norm
from modelpar.optim.data_parallel import DataParallelOptimizer, _nothing
from modelpar.optim.param_info import ParamInfo, ParamsWithInfo
from modelpar.optim.state import MOMENTS, moment_kinds, switch_error
from modelpar.parallel.dtensors import is_dtensor
from modelpar.parallel.groups import ParallelGroups

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def shard_rank_and_size(t: DTensor) -> tuple[int, int]:
    """This rank's index along the mesh dimension ``t`` is sharded over, and that dimension's size."""
    mesh = t.device_mesh
    dim = mesh.ndim - 1  # the shard dimension is the last (1-D, or (replicate, shard))
    return mesh.get_local_rank(dim), mesh.size(dim)


def is_sharded(t: torch.Tensor | None) -> bool:
    return is_dtensor(t)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its dp shard if ``t`` is sharded)."""
    return t.to_local() if is_dtensor(t) else t


def full_local(t: torch.Tensor) -> torch.Tensor:
    """The whole tp-local tensor of a dp-sharded one (collective over its mesh); ``t`` itself otherwise."""
    return t.full_tensor() if is_dtensor(t) else t


def dp_rows(t: torch.Tensor) -> slice:
    """The rows (dim 0) of the whole tp-local tensor that this rank's part of ``t`` holds: all of them, or
    the dp shard's (FSDP2 shards dim 0 as ``torch.chunk`` does)."""
    if not is_dtensor(t):
        return slice(0, t.shape[0])
    rank, size = shard_rank_and_size(t)
    start = min(rank * -(-t.shape[0] // size), t.shape[0])
    return slice(start, start + t.to_local().shape[0])


def load_local(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Write ``whole`` (the tp-local tensor) into ``target``: all of it, or the dp shard ``target`` holds."""
    if not is_dtensor(target):
        target.copy_(whole)
        return
    target.to_local().copy_(whole[dp_rows(target)])


class FullyShardedAdamW(DataParallelOptimizer):
    """``optim.zero=2|3``: AdamW over FSDP2-sharded parameters (see the module docstring)."""

    def __init__(
        self,
        params_with_info: ParamsWithInfo,
        groups: ParallelGroups,
        *,
        chunks: list[torch.nn.Module] = (),
        reduce_every_micro_batch: bool = False,
        zero: int = 3,
        **adam,
    ):
        super().__init__(params_with_info, groups)
        # stage 3 frees a chunk's weights after each backward; stage 2 keeps them gathered until the step reduces
        self._reshard_every_backward = zero == 3
        self._switches: dict[int, tuple[bool, bool]] = {}  # chunk -> (reshard after backward, gradient sync)
        self.optimizer = build_adamw(self.params_with_info, rows=dp_rows, **adam)
        self.chunks = list(chunks)  # the FSDP2 roots, in the pipeline runtime's local order
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self._micro_batches = 1
        first = next((p for p, i in self.params_with_info if is_dtensor(p) and not i.expert_parallel), None)
        # the group whose ranks hold different shards, where hybrid sharding replicates them: the norm sums over
        # it; None: all of dp x cp, where under ep the experts are sharded over the ranks holding the same ones,
        # so over dp x cp each expert value too is held once
        hybrid = first is not None and first.device_mesh.ndim > 1
        self.shard_group = first.device_mesh.get_group(first.device_mesh.ndim - 1) if hybrid else None

    @property
    def frees_weights_inside_a_step(self) -> bool:
        """Whether a chunk's gathered weights are freed after a forward or backward before the step ends (stage
        3, or every backward reducing): two micro-batches through one chunk at once could then free what the
        other still reads (the trainer runs such DualPipeV pairs in order)."""
        return self._reshard_every_backward or self.reduce_every_micro_batch

    def expect_micro_batches(self, micro_batches: int) -> None:
        """Gradients accumulate unsharded until each chunk's last micro-batch, which reduce-scatters them once
        (``before_backward``, or ``after_weight_backward`` under a split backward); with
        ``reduce_every_micro_batch`` every micro-batch does (less memory). Until a hook says otherwise no
        backward reduces, and weights stay gathered after a backward (a split one's W may still need them)."""
        self._micro_batches = micro_batches
        for chunk in range(len(self.chunks)):
            self._set(chunk, reshard=False, sync=False)

    def _reduces(self, micro_batch: int) -> bool:
        return micro_batch == self._micro_batches - 1 or self.reduce_every_micro_batch

    def before_backward(self, chunk: int, micro_batch: int) -> None:
        """The pipeline runtime's hook before a fused backward through ``chunk``: FSDP2's own post-backward
        hooks, on the last micro-batch, reduce-scatter the gradients, and free the weights after it (stage 3:
        after every backward; stage 2 keeps them gathered from the first forward to the last backward)."""
        if self.chunks:
            reduces = self._reduces(micro_batch)
            self._set(chunk, reshard=reduces or self._reshard_every_backward, sync=reduces)

    def _set(self, chunk: int, *, reshard: bool, sync: bool) -> None:
        """FSDP2's two switches of a chunk; each setter walks every module, so only on a change."""
        if self._switches.get(chunk) != (reshard, sync):
            self.chunks[chunk].set_reshard_after_backward(reshard)
            self.chunks[chunk].set_requires_gradient_sync(sync)
            self._switches[chunk] = (reshard, sync)

    def before_weight_backward(self, chunk: int, micro_batch: int) -> None:
        """The runtime's hook before a split backward's W: the chunk's weights gathered (a no-op when its B
        left them so; a forward in between may have freed them at stage 3)."""
        if not self.chunks:
            return
        from torch.distributed.fsdp import FSDPModule  # loaded by fully_shard, which made these chunks

        modules = [m for m in self.chunks[chunk].modules() if isinstance(m, FSDPModule)]
        for handle in [m.unshard(async_op=True) for m in modules]:
            handle.wait()

    def after_weight_backward(self, chunk: int, micro_batch: int) -> None:
        """The runtime's hook after a W: FSDP2's backward ends there; after the chunk's last W its accumulated
        gradients are reduce-scattered and its gathered weights freed (see the module docstring)."""
        if self.chunks:
            reduce = self._reduces(micro_batch)
            _end_weight_backward(self.chunks[chunk], reduce=reduce)
            if reduce:  # it flipped both switches: the next _set must apply its values
                self._switches.pop(chunk, None)

    def reduce_gradients(self, other_reductions: Callable[[], None] = _nothing, defer_flags: bool = False) -> None:
        # FSDP2 reduce-scattered each block's gradients in backward (experts: summed over the ranks holding them,
        # divided by dp x cp): what is left commutes with that average
        other_reductions()

    def _has_grad_flags(self) -> torch.Tensor:
        raise AssertionError("no deferred flags under FSDP2")  # _flags_pending is never set

    def _drop_unused(self, values: list[float]) -> None:
        return None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        shards = [(_LocalGrad(p), _local_share(p, info)) for p, info in self.params_with_info]
        return clip_grad_norm(shards, max_norm, self.groups, zero_sharded=True, dp_group=self.shard_group)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_moments(self) -> tuple[dict[int, dict[str, torch.Tensor]], float] | None:
        state_of = {id(p): st for p, st in self.optimizer.state.items()}
        steps = {float(st["step"]) for st in state_of.values() if "step" in st}  # Muon's state has none
        if len(steps) != 1 or len(state_of) != len(self.params_with_info):
            return None
        out = {}
        muon = self.muon_param_ids()
        for p, _ in self.params_with_info:  # the same order on every dp rank: the gathers pair up
            st = self.optimizer.state[p]
            out[id(p)] = {kind: full_local(st[kind]) for kind in moment_kinds(id(p) in muon)}
        return out, steps.pop()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Whole tp-local moments (``resharded_optimizer_state``) into this rank's dp shards."""
        muon = self.muon_param_ids()
        for p, info in self.params_with_info:
            kinds = moment_kinds(id(p) in muon)
            if f"{moment_kinds(id(p) not in muon)[0]}/{info.name}" in tensors:
                raise switch_error(info.name, saved_muon=id(p) not in muon)
            if f"{kinds[0]}/{info.name}" not in tensors:
                continue
            state = self.optimizer.state[p]
            for kind in kinds:
                moment = torch.zeros_like(p)
                load_local(moment, tensors[f"{kind}/{info.name}"].to(p.device, p.dtype))
                state[kind] = moment
            if kinds == MOMENTS:  # torch's Muon keeps no step count
                state["step"] = tensors[f"step/{info.name}"].clone()


def _end_weight_backward(chunk: torch.nn.Module, reduce: bool) -> None:
    """End a split backward's W through ``chunk`` as FSDP2 ends any backward it saw start (W starts inside the
    blocks, mostly past the output hooks that queue it): its root's end-of-backward callback, which runs each
    parameter group's post-backward (gradient accumulators; no reduction while sync is off; idempotent, so
    it may have run already) and returns every group to idle, also those a full-recompute rerun inside W
    left mid-forward (the rerun stops early, before FSDP2's post-forward hook). With ``reduce``
    the post-backwards run first with sync on: the accumulated unsharded gradients are reduce-scattered into
    the sharded ``.grad`` (mixed-precision accumulators, hybrid all-reduce and averaging as FSDP2 does them)
    and the gathered weights freed, as ``torch.distributed.pipelining``'s REDUCE_GRAD step does. Private FSDP2
    calls (it has no public one for a backward outside autograd's hooks): checked against torch 2.13."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(chunk)
    if reduce:
        chunk.set_requires_gradient_sync(True)
        chunk.set_reshard_after_backward(True)
        for member in state._state_ctx.all_states:
            for param_group in member._fsdp_param_groups:
                param_group.post_backward()
    state._root_post_backward_final_callback()
    if reduce:  # until the next hook says otherwise (the memory mode reduces again after the next W)
        chunk.set_requires_gradient_sync(False)
        chunk.set_reshard_after_backward(False)


def _local_share(param: torch.Tensor, info: ParamInfo) -> ParamInfo:
    """``info`` with a per-row ``norm_share`` cut to the rows of ``param``'s dp shard."""
    if not isinstance(info.norm_share, torch.Tensor) or not is_dtensor(param):
        return info
    return replace(info, norm_share=info.norm_share[dp_rows(param)])


class _LocalGrad:
    """A parameter seen through its local shard, for ``clip_grad_norm`` (which sums squares of ``.grad``
    and scales ``.grad`` in place): the dp shards' squares are summed over dp x cp by ``zero_sharded``."""

    __slots__ = ("param",)

    def __init__(self, param: torch.nn.Parameter):
        self.param = param

    @property
    def grad(self) -> torch.Tensor | None:
        return None if self.param.grad is None else local(self.param.grad)

    @property
    def device(self) -> torch.device:
        return local(self.param).device


__all__ = [
    "FullyShardedAdamW",
    "dp_rows",
    "full_local",
    "is_sharded",
    "load_local",
    "local",
]
