"""Build one rank of a training job from its recipe: device, model chunks, pipeline runtime, optimizer, data.

Every layout runs this same code; ``tp = pp = dp = 1`` is the single-device run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from modelpar.data import (
    Blend,
    BlendSampler,
    DataError,
    TokenFile,
    WindowSampler,
    WindowSet,
    open_blend,
    open_dataset,
)
from modelpar.model.flops import half_block_training_flops, head_training_flops
from modelpar.model.parallelize import Parallelism, parallelize
from modelpar.model.spec import ChunkSpec
from modelpar.model.transformer import ModelChunk
from modelpar.optim import DataParallelOptimizer, ParamInfo, build_optimizer, default_decay
from modelpar.optim.muon import MuonSettings
from modelpar.optim.muon_layout import MuonLayout, build_muon_layout
from modelpar.parallel.groups import ParallelGroups
from modelpar.pipeline import Partition, PipelineRuntime, build_schedule, partition_explicit, partition_uniform
from modelpar.pipeline.partition import partition_by_cost
from modelpar.pipeline.schedule import placement_for, single_micro_batch
from modelpar.training.config import RecipeError, TrainConfig


def resolve_device(cfg: TrainConfig) -> torch.device:
    """The device this rank computes on (``trainer.device``; auto: the local GPU if there is one)."""
    want = cfg.trainer.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # trainer.dtype, optim.reduce_dtype


def resolve_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The compute dtype of activations; parameters and optimizer state stay fp32 (master weights)."""
    if cfg.trainer.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.trainer.dtype]


def build_partition(cfg: TrainConfig) -> Partition:
    """The layer split, placed on ranks as the schedule places chunks (interleaved, or V for zbv/dualpipev)."""
    return replace(_layer_split(cfg), placement=placement_for(cfg.parallel.schedule))


def _layer_split(cfg: TrainConfig) -> Partition:
    p, layers = cfg.parallel, cfg.model.layers
    if p.partition == "explicit":
        return partition_explicit(list(p.stage_layers), layers, p.pp, p.vpp)
    if p.partition == "params":
        shape = cfg.model
        embed = cfg.model.vocab_size * cfg.model.hidden
        return partition_by_cost([shape.block_params()] * layers, p.pp, p.vpp, embedding_cost=embed, head_cost=embed)
    if p.partition in ("flops", "blocks"):
        # training FLOPs per token of each half block (attention, MLP) against the last chunk's head and loss;
        # the embedding lookup is free. Balancing the head against blocks follows Narayanan et al. 2021 sec. 3.2;
        # cutting between a block's halves (flops) lets the stages even out where whole blocks (blocks) cannot.
        shape = cfg.model
        # per block: a MoE block's MLP costs its active experts, not the dense MLP's
        halves = [half_block_training_flops(shape, cfg.data.seq_len, i) for i in range(layers)]
        head = head_training_flops(shape)
        if p.partition == "blocks":
            return partition_by_cost([a + m for a, m in halves], p.pp, p.vpp, head_cost=head)
        return partition_by_cost([c for half in halves for c in half], p.pp, p.vpp, head_cost=head, halves=True)
    return partition_uniform(layers, p.pp, p.vpp)


@dataclass
class RankModel:
    """This rank's chunks and everything derived from them that a step needs."""

    chunks: list[ModelChunk]
    params: list[tuple[torch.nn.Parameter, ParamInfo]]
    tied: list[torch.nn.Parameter]  # this rank's copies of a tied embedding that lives on two stages
    dtype: torch.dtype = torch.float32  # the compute dtype of activations (parameters stay fp32)
    whole_experts: list[torch.nn.Parameter] = field(default_factory=list)  # experts FSDP2 left whole


def chunk_specs(cfg: TrainConfig, pp_rank: int, device: torch.device) -> list[ChunkSpec]:
    """The specs of the chunks pipeline rank ``pp_rank`` holds: its place in the partition and how it runs."""
    p, partition = cfg.parallel, build_partition(cfg)
    return [
        ChunkSpec(
            tuple(partition.layers(c)),
            first=partition.has_embedding(c),
            last=partition.has_head(c),
            split_blocks=partition.split_blocks(c),
            sequence_parallel=p.sp,
            sp_keep_shard=p.sp_keep_shard,
            recompute=p.recompute,
            recompute_modules=tuple(p.recompute_modules),
            cp_comm=p.cp_comm,
            cp_a2a=p.cp_a2a,
            fp8=cfg.model.fp8,
            device=device,
        )
        for c in partition.chunks_of(pp_rank)
    ]


def parallelism(cfg: TrainConfig, dtype: torch.dtype) -> Parallelism:
    """What ``parallelize`` applies to the built chunks, from the recipe (``dtype``: the compute dtype)."""
    return Parallelism(
        micro_batches=cfg.parallel.microbatches,
        offload_activations=cfg.parallel.offload_activations,
        compile=cfg.model.compile,
        zero=cfg.optim.zero,
        compute_dtype=dtype,
        reduce_dtype=DTYPES[cfg.optim.reduce_dtype],
        zero_group=cfg.optim.zero_group,
    )


def build_rank_model(cfg: TrainConfig, groups: ParallelGroups, device: torch.device) -> RankModel:
    """This rank's model, the one path every rank of every layout takes: its chunks built from their specs
    (layout-invariant init from ``trainer.seed``), made parallel (``modelpar.model.parallelize``), and their
    parameters described for the optimizer."""
    dtype = resolve_dtype(cfg, device)
    chunks = []
    for spec in chunk_specs(cfg, groups.pp_rank, device):
        chunks.append(ModelChunk(cfg.model, spec, groups))
        chunks[-1].initialise(cfg.trainer.seed)
    shared = cfg.model.tie_embeddings or cfg.model.mtp_depth  # the last stage uses the embedding too
    if shared and len(chunks) > 1 and chunks[0].first and chunks[-1].last:
        chunks[-1].share_embedding(chunks[0].embed_tokens.weight)  # V placement: both ends on this rank, one weight
    whole_experts = parallelize(chunks, groups, parallelism(cfg, dtype), report=print if groups.rank == 0 else _quiet)
    params, tied = describe_params(cfg, chunks, groups)
    return RankModel(chunks, params, tied, dtype, whole_experts)


def describe_params(
    cfg: TrainConfig, chunks: list[ModelChunk], groups: ParallelGroups
) -> tuple[list[tuple[torch.nn.Parameter, ParamInfo]], list[torch.nn.Parameter]]:
    """Each trainable parameter of ``chunks`` once, with what the optimizer needs to know of it, and this
    rank's copies of a tied embedding that lives on two stages."""
    partition = build_partition(cfg)
    shared = cfg.model.tie_embeddings or cfg.model.mtp_depth > 0  # multi-token prediction embeds on the last stage
    tied_across_stages = shared and partition.rank_of(0) != partition.rank_of(partition.n_chunks - 1)
    experts = {id(p) for chunk in chunks for moe in chunk.moe_layers().values() for p in moe.expert_parameters()}
    params: list[tuple[torch.nn.Parameter, ParamInfo]] = []
    tied: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for chunk in chunks:
        shards = chunk.logical_shards()
        for name, param in chunk.named_parameters():
            if id(param) in seen or not param.requires_grad:  # a router's balancing bias moves by rule, not AdamW
                continue
            seen.add(id(param))
            logical = [(n, s) for n, s in shards.items() if s.param is param]
            share = _norm_share(param, logical)
            if tied_across_stages and any(n == "embed_tokens.weight" for n, _ in logical):
                tied.append(param)
                if not chunk.first:
                    share = 0.0  # the first stage counts the tied weight; this is its copy
            info = ParamInfo(
                name=f"{_chunk_name(chunk)}.{name}",
                decay=default_decay(name, param),
                norm_share=share,
                expert_parallel=id(param) in experts and len(groups.ep_ranks) > 1,
                uses=sum(any(q is param for q in c.parameters()) for c in chunks),
            )
            params.append((param, info))
    return params, tied


def _norm_share(param: torch.nn.Parameter, logical) -> float | torch.Tensor:
    """What this rank adds of ``param``'s squared gradient to the global norm: each value counted once.

    Rows of a logical tensor replicated over tp (norm weights, kv heads when kv_heads < tp) count on the
    primary rank only. A fused parameter mixing counted and uncounted rows gets a per-row weight vector.
    """
    rows = torch.ones(param.shape[0], dtype=torch.float32, device=param.device)
    for _, shard in logical:
        if not shard.primary:
            rows[shard.local_rows] = 0.0
    if bool((rows == rows[0]).all()):
        return float(rows[0])
    return rows


def _chunk_name(chunk: ModelChunk) -> str:
    if not chunk.layer_ids:
        return "chunk"
    first, last = chunk.layer_ids[0], chunk.layer_ids[-1]
    return f"layers{first}{'.mlp' * (chunk.split_blocks.get(first) == 'mlp')}-{last}" + (
        ".attention" if chunk.split_blocks.get(last) == "attention" else ""
    )


def build_runtime(
    cfg: TrainConfig,
    model: RankModel,
    groups: ParallelGroups,
    device: torch.device,
    dtype: torch.dtype,
    *,
    rerun: bool = False,
) -> PipelineRuntime:
    """This rank's pipeline runtime over its chunks; activations cross stages in the compute dtype.
    ``rerun``: the runtime that repeats a step's first micro-batch (``training.sdc``)."""
    layout = groups.layout
    micro_batch_size = cfg.data.global_batch // layout.dp // cfg.parallel.microbatches
    first, last = model.chunks[0], model.chunks[-1]
    m = cfg.parallel.microbatches
    if rerun:  # one micro-batch, loss scaled by 1/m as in the step: the step's values, bit for bit
        schedule = single_micro_batch(cfg.parallel.schedule, layout.pp, layout.vpp)
    else:
        schedule = build_schedule(cfg.parallel.schedule, layout.pp, m, layout.vpp)
    return PipelineRuntime(
        model.chunks,
        groups,
        schedule,
        activation_shape=first.activation_shape(micro_batch_size, cfg.data.seq_len),
        loss_fn=last.loss if last.last else _no_loss,
        dtype=dtype,
        device=device,
        loss_divisor=m,
    )


def muon_settings(cfg: TrainConfig) -> MuonSettings:
    """Muon's hyper-parameters from the recipe's ``optim.muon_*``."""
    o = cfg.optim
    return MuonSettings(
        lr_scale=o.muon_lr_scale,
        weight_decay=o.weight_decay if o.muon_weight_decay < 0 else o.muon_weight_decay,
        momentum=o.muon_momentum,
        nesterov=o.muon_nesterov,
        ns_steps=o.muon_ns_steps,
        adjust_lr=o.muon_adjust_lr,
        ns_dtype=o.muon_ns_dtype,
        adamw_for=tuple(o.muon_adamw_for),
        per_head_rows=cfg.model.head_size if o.muon_per_head else 0,
    )


def build_muon_layout_for(cfg: TrainConfig, model: RankModel, groups: ParallelGroups) -> MuonLayout | None:
    """Where this rank's Muon matrices live (``optim.name=muon``), else None. Collective over the stage."""
    if cfg.optim.name != "muon":
        return None
    shards = {}
    for chunk in model.chunks:
        shards |= chunk.logical_shards()
    replicas = {}
    if cfg.optim.zero == 0:  # replicas over dp x cp (experts: over the ranks holding them) share the writing
        dense, expert = (_replica(groups.rank, ranks) for ranks in (groups.dp_cp_ranks, groups.expert_dp_ranks))
        replicas = {id(p): expert if info.expert_parallel else dense for p, info in model.params}
    return build_muon_layout(
        muon_settings(cfg),
        [p for p, _ in model.params],
        shards,
        stage_group=groups.stage_group(),
        tp_group=groups.tp_group,
        replicas=replicas,
    )


def _replica(rank: int, ranks: tuple[int, ...]) -> tuple[int, int]:
    """This rank's index among the replicas ``ranks`` (every one holds the same values), and their number."""
    return (ranks.index(rank), len(ranks)) if ranks else (0, 1)


def build_rank_optimizer(cfg: TrainConfig, model: RankModel, groups: ParallelGroups) -> DataParallelOptimizer:
    """The optimizer (AdamW, or Muon and AdamW) over this rank's parameters at ZeRO stage ``optim.zero``."""
    o = cfg.optim
    return build_optimizer(
        model.params,
        groups,
        zero=o.zero,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        bucket_bytes=int(o.bucket_mb * 2**20),
        chunks=model.chunks,
        reduce_every_micro_batch=o.reduce_every_micro_batch,
        muon_layout=build_muon_layout_for(cfg, model, groups),
    )


def build_data(
    cfg: TrainConfig, data_path: str | Blend, groups: ParallelGroups
) -> tuple[TokenFile | WindowSet, WindowSampler]:
    """The windows (a token file, a shard directory or a blend) and this dp replica's resumable sampler."""
    d, dp_rank, dp = cfg.data, groups.dp_rank, groups.layout.dp
    if isinstance(data_path, Blend):
        windows, sizes = open_blend(data_path, cfg.model.vocab_size, d.seq_len)
        return windows, BlendSampler(sizes, data_path.weights, d.global_batch, dp_rank, dp, d.seed)
    tokens = open_dataset(data_path, cfg.model.vocab_size, d.seq_len)
    return tokens, WindowSampler(tokens.num_windows, d.global_batch, dp_rank, dp, d.seed)


def resolve_eos_id(cfg: TrainConfig, data_path: str) -> int | None:
    """The id ending a document, for ``data.document_mask`` (None when off): ``data.eos_id``, else the EOS of
    the tokenizer that prepared ``data_path``. Raises ``RecipeError`` (one line) when there is none."""
    if not cfg.data.document_mask:
        return None
    if cfg.data.eos_id >= 0:
        return cfg.data.eos_id
    from modelpar.data.prepare import tokenizer_for

    try:
        eos = tokenizer_for(data_path).eos_id
    except (DataError, OSError, ValueError):
        eos = None
    if eos is None:
        raise RecipeError(
            f"data.document_mask=true needs an EOS id, and {data_path} names no tokenizer that has one; "
            "set data.eos_id or prepare the data with `modelpar-data prepare`"
        )
    return eos


def _quiet(line: str) -> None:
    return None


def _no_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the loss runs on the last pipeline stage only")
