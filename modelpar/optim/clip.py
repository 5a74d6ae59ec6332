"""Global gradient-norm clipping with every parameter counted exactly once across tp, pp and dp (x cp)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from modelpar.optim.param_info import ParamsWithInfo
from modelpar.parallel import collectives
from modelpar.parallel.groups import ParallelGroups

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_, so a norm just at max_norm is left alone


def _local_sum_of_squares(params_with_info: ParamsWithInfo, group: dist.ProcessGroup) -> torch.Tensor:
    """``sum(norm_share * ||grad||^2)`` over this rank's gradients, as a fp32 ``[1]`` tensor."""
    grads = [(p.grad, info.norm_share) for p, info in params_with_info if p.grad is not None]
    if params_with_info:
        device = params_with_info[0][0].device
    else:  # a ZeRO-1 shard of padding only: still joins the all-reduce, on a device the backend accepts
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for grad, share in grads:
        squares = grad.detach().float().square()
        if isinstance(share, torch.Tensor):  # per-row weights: a fused weight mixing counted and uncounted rows
            weights = share.to(squares.device).view(share.shape + (1,) * (squares.dim() - share.dim()))
            squares = torch.where(weights > 0, squares * weights, torch.zeros_like(squares))
            total += squares.sum()
        elif share:  # a zero share must not turn an inf in an uncounted copy into nan
            total += share * squares.sum()
    return total


def clip_grad_norm(
    params_with_info: ParamsWithInfo,
    max_norm: float,
    groups: ParallelGroups,
    zero_sharded: bool = False,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale every gradient by ``max_norm / norm`` when the global norm exceeds it; return the norm before
    clipping as a 0-d fp32 tensor on the gradients' device. Nothing is read back to the host.

    The squared norm is summed over the tp and pp groups of ``groups`` (a ``ParallelGroups``), each rank
    weighting a parameter by its ``norm_share``. Data-parallel replicas hold the same averaged gradients and are
    not summed, unless ``zero_sharded``: then ``params_with_info`` are ZeRO-1 shard segments
    (``ZeroOneAdamW.shard_params_with_info()``) and the dp group is summed too (``dp_group``, default dp x cp:
    the group whose ranks hold different shards). A non-finite norm (inf or nan)
    is returned as is and nothing is scaled: the caller decides to skip the step. ``max_norm <= 0`` only measures.
    """
    total = _local_sum_of_squares(params_with_info, groups.tp_group)
    experts = [(p, info) for p, info in params_with_info if info.expert_parallel]
    # each ep rank holds other experts: their squares add up over ep. Under ZeRO summed over all of dp x cp
    # (dp_group None) they already do: ZeRO-1 and ZeRO-2/3 shard the experts over the ranks holding the same
    # ones (or leave them whole when no other rank does), so dp x cp holds each expert value once
    if experts and len(groups.ep_ranks) > 1 and not (zero_sharded and dp_group is None):
        dense = [(p, info) for p, info in params_with_info if not info.expert_parallel]
        expert_total = _local_sum_of_squares(experts, groups.tp_group)
        with collectives.comm_tag("grad_norm"):
            collectives.all_reduce(expert_total, groups.ep_group)
        total = _local_sum_of_squares(dense, groups.tp_group) + expert_total
    reduce_over = [(groups.tp_group, groups.tp_ranks), (groups.pp_group, groups.pp_ranks)]
    if zero_sharded:  # ZeRO shards over dp x cp (or over the shard blocks of hybrid sharding)
        group = groups.dp_cp_group if dp_group is None else dp_group
        reduce_over.append((group, range(dist.get_world_size(group))))
    with collectives.comm_tag("grad_norm"):
        for group, ranks in reduce_over:
            if len(ranks) > 1:
                collectives.all_reduce(total, group)
    norm = total.sqrt().reshape(())  # a negative (impossible) or nan sum gives nan, which fails every comparison
    grads = [p.grad for p, _ in params_with_info if p.grad is not None]
    if max_norm > 0 and grads:
        # on device, as torch.nn.utils.clip_grad_norm_: a coefficient of exactly 1 leaves the gradients' bits alone
        coef = (max_norm / (norm + _EPS)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
