"""Make a rank's built chunks parallel: one function per technique, applied by ``parallelize`` in a fixed order.

    chunks = [ModelChunk(config, spec, groups) for spec in specs]     # tp, cp, ep and sp: inside the layers
    whole_experts = parallelize(chunks, groups, Parallelism(zero=3, compute_dtype=torch.bfloat16))

Tensor, context, expert and sequence parallelism are the layers' own (each layer owns its split, from the
``ChunkSpec``); what is applied from above to the built chunks, in this order, is

1. ``apply_moe_settings``: the step's micro-batch count each MoE layer divides its auxiliary loss by;
2. ``apply_offload``: saved activations of the blocks wait for backward in host memory;
3. ``apply_compile``: every block under ``torch.compile``;
4. ``apply_fsdp``: ZeRO-2/3, gradients (and at stage 3 weights) sharded over dp x cp by torch's FSDP2.

A new technique is a new ``apply_*`` function here and a field of ``Parallelism``; the optimizer never shards
the model, it takes the parameters as they come out of here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from modelpar.model.activations import ActivationOffload
from modelpar.model.compile import compile_blocks
from modelpar.model.moe import RoutedExperts
from modelpar.model.transformer import Block, ModelChunk
from modelpar.parallel.groups import ParallelGroups, keep_group

SHARDED_STAGES = (2, 3)


@dataclass(frozen=True)
class Parallelism:
    """What ``parallelize`` applies to a rank's chunks.

    ``micro_batches``: per optimizer step (each one's MoE auxiliary loss counts 1/m). ``offload_activations``,
    ``compile``: see ``apply_offload`` and ``apply_compile``. ``zero`` 2 or 3: FSDP2 (``apply_fsdp``), with
    weights all-gathered in ``compute_dtype``, gradients reduce-scattered in ``reduce_dtype`` and hybrid
    sharding over blocks of ``zero_group`` dp x cp ranks (0: all of them); other stages leave the parameters
    to the optimizer.
    """

    micro_batches: int = 1
    offload_activations: bool = False
    compile: bool = False
    zero: int = 0
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    zero_group: int = 0


def parallelize(
    chunks: list[ModelChunk],
    groups: ParallelGroups,
    plan: Parallelism,
    *,
    report: Callable[[str], None] | None = None,
) -> list[torch.nn.Parameter]:
    """Apply ``plan`` to this rank's ``chunks`` in place, in the module docstring's order; ``report`` gets the
    compile-time line. Returns the expert parameters FSDP2 left whole (no other rank holds them), whose
    gradients the gradient finalisation averages (``modelpar.optim.finalize``)."""
    apply_moe_settings(chunks, plan.micro_batches)
    if plan.offload_activations:
        apply_offload(chunks)
    if plan.compile:
        apply_compile(chunks, report)
    if plan.zero in SHARDED_STAGES:
        return apply_fsdp(
            chunks,
            groups,
            plan.zero,
            compute_dtype=plan.compute_dtype,
            reduce_dtype=plan.reduce_dtype,
            shard_group=plan.zero_group,
        )
    return []


def apply_moe_settings(chunks: list[ModelChunk], micro_batches: int) -> None:
    """Each MoE layer's auxiliary loss of a micro-batch counts 1/``micro_batches`` of the step's."""
    for chunk in chunks:
        for moe in chunk.moe_layers().values():
            moe.micro_batches = micro_batches


def apply_offload(chunks: list[ModelChunk]) -> None:
    """One ``ActivationOffload`` for every chunk: the blocks' saved activations (never the parameters) move to
    host memory until backward (``modelpar.model.activations``)."""
    offload = ActivationOffload(exclude=[p for chunk in chunks for p in chunk.parameters()])
    for chunk in chunks:
        chunk.offload = offload


def apply_compile(chunks: list[ModelChunk], report: Callable[[str], None] | None = None) -> None:
    """Every block under ``torch.compile`` (``modelpar.model.compile``)."""
    compile_blocks(chunks, report=report)


def apply_fsdp(
    chunks: list[ModelChunk],
    groups: ParallelGroups,
    zero: int,
    *,
    compute_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    shard_group: int = 0,
) -> list[torch.nn.Parameter]:
    """ZeRO-2/3: ``fully_shard`` on each block of ``chunks``, then on each chunk (the embedding, final norm and
    head), over a mesh of this rank's dp x cp group, on top of the tensor-parallel shards: a parameter's dp
    shard is a slice along dim 0 of its tp shard. Returns the expert parameters left whole (below).

    At stage 3 a block's weights are all-gathered just before its forward (FSDP2 prefetches the next block's)
    and freed after it; at stage 2 they stay gathered from forward to backward. When gradients reduce, and
    how a split backward (ZB-H1) drives FSDP2, is the optimizer's (``modelpar.optim.fsdp``). With a bf16
    ``compute_dtype`` the weights are all-gathered in bf16 (half the bytes) from the sharded fp32 masters, and
    gradients are reduce-scattered in ``reduce_dtype`` before landing in fp32. ``shard_group`` > 0
    (``optim.zero_group``): hybrid sharding, shards over blocks of that many consecutive dp x cp ranks (a
    node, say) and replicas across the blocks; gradients are reduce-scattered inside a block and all-reduced
    across blocks. Parameters without a gradient (a sigmoid router's balancing bias, moved by rule) are not
    sharded (``ignored_params``).

    **Expert parallelism** (ep > 1; as torchtitan does it). The ep ranks of a block hold different experts, so
    the experts cannot shard over dp x cp with the rest of the block. Each MoE layer's ``RoutedExperts`` gets
    its own ``fully_shard``, before the block's, over a mesh of the expert data-parallel group (the ranks
    holding the same experts); the block's ``fully_shard`` then leaves them out. Their gradients are
    reduce-scattered there, summed and divided by all of dp x cp (each rank's loss is a mean over its own
    tokens; on gloo, which has no ``PREMUL_SUM``, a sum then a division), as zero-0 averages them. When no
    other rank holds a rank's experts (ep = dp x cp) they stay whole on it, outside FSDP2, and are returned:
    their gradients are divided by dp x cp when the step's gradients are finalised. Either way every expert
    value lives on exactly one rank of dp x cp. Not with hybrid sharding. FSDP2 shards dim 0, the local
    experts: with fewer local experts than expert data-parallel ranks some ranks hold none (correct,
    unbalanced memory).
    """
    if zero not in SHARDED_STAGES:
        raise ValueError(f"zero={zero} is not a sharded stage {SHARDED_STAGES}")
    split_experts = groups.layout.ep > 1
    if split_experts and shard_group not in (0, len(groups.dp_cp_ranks)):
        raise ValueError(f"zero_group={shard_group} with ep={groups.layout.ep}: experts are not hybrid-sharded")
    device = next(p for c in chunks for p in c.parameters()).device.type
    mesh = dp_cp_mesh(groups, shard_group, device)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # ZeRO-2/3 only: a second to import

    policy = MixedPrecisionPolicy()
    if compute_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    expert_mesh = None
    if split_experts and len(groups.expert_dp_ranks) > 1:
        keep_group(groups.expert_dp_group)
        expert_mesh = DeviceMesh.from_group(groups.expert_dp_group, device)
    whole: list[torch.nn.Parameter] = []
    for chunk in chunks:
        # what moves by rule, not by gradient (a sigmoid router's balancing bias), stays whole on every rank
        ruled = {p for p in chunk.parameters() if not p.requires_grad}
        experts = [m for m in chunk.modules() if isinstance(m, RoutedExperts)] if split_experts else []
        for module in experts:  # first: the blocks' own fully_shard then leaves them out
            if expert_mesh is None:  # no other rank holds these experts: whole here, averaged when finalised
                ruled |= set(module.parameters())
                whole += list(module.parameters())
                continue
            fully_shard(module, mesh=expert_mesh, reshard_after_forward=zero == 3, mp_policy=policy)
            module.set_gradient_divide_factor(float(len(groups.dp_cp_ranks)))  # summed over expert dp, / dp x cp
            if dist.get_backend(groups.expert_dp_group) != "nccl":  # gloo has no PREMUL_SUM: sum, then divide
                module.set_force_sum_reduction_for_comms(True)
        for module in chunk.modules():
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=policy, ignored_params=ruled)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=policy, ignored_params=ruled)
    return whole


def dp_cp_mesh(groups: ParallelGroups, shard_group: int, device: str) -> DeviceMesh:
    """The dp x cp group as a mesh: 1-D, or (replicate, shard) blocks of ``shard_group`` ranks. Collective over
    the world (every rank creates every block's groups, in the same order)."""
    size = len(groups.dp_cp_ranks)
    if shard_group in (0, size):
        keep_group(groups.dp_cp_group)
        return DeviceMesh.from_group(groups.dp_cp_group, device)
    if size % shard_group:
        raise ValueError(f"zero_group={shard_group} must divide dp x cp = {size}")
    mine_shard = mine_replicate = mesh = None
    rank = dist.get_rank()
    for ranks in groups.layout.all_dp_cp_groups():
        blocks = [ranks[i : i + shard_group] for i in range(0, len(ranks), shard_group)]
        for block in blocks:
            group = dist.new_group(block)
            mine_shard = group if rank in block else mine_shard
        for j in range(shard_group):
            across = [block[j] for block in blocks]
            group = dist.new_group(across)
            mine_replicate = group if rank in across else mine_replicate
        if rank in ranks:
            mesh = torch.tensor(blocks)
    return DeviceMesh.from_group([mine_replicate, mine_shard], device, mesh=mesh, mesh_dim_names=("replicate", "shard"))


__all__ = [
    "SHARDED_STAGES",
    "Parallelism",
    "apply_compile",
    "apply_fsdp",
    "apply_moe_settings",
    "apply_offload",
    "dp_cp_mesh",
    "parallelize",
]
