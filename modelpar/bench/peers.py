"""The peers ``modelpar-bench`` races: the same model driven by PyTorch's own parallelism.

Every peer starts from our tp=1 ``ModelChunk``s (``build_chunk`` with ``groups=None``, the same seed), so its
weights equal ours element for element, and trains on the batches our sampler gives our trainer:

- pipeline layouts: ``torch.distributed.pipelining`` (``PipelineStage`` around each of this rank's chunks,
  ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``), loss = our chunk's ``loss``;
- tensor-parallel layouts: DTensor (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``,
  torchtitan's plan), with ``loss_parallel`` so the logits are never gathered, as ours;
- both together on a ``(pp, tp)`` device mesh; data parallel: ``DistributedDataParallel`` (``optim.zero=0|1``),
  or with ``optim.zero=2|3`` FSDP2: ``fully_shard`` on each block, then on the chunk, over the dp mesh, weights
  kept gathered from forward to backward (``reshard_after_forward=False``, ZeRO-2) or freed after each
  (ZeRO-3), gradients reduce-scattered by the last micro-batch's backward only, as ours.

DTensor's parallel styles accept ``nn.Linear`` and ``nn.Embedding`` only, and our single-device layers are
``ColumnParallelLinear`` & co. with fused weights: q, k, v in one ``qkv_proj`` and gate, up in one
``gate_up_proj``. A plain ``Shard(0)`` of a fused weight would hand rank 0 all of q and rank 1 k and v, so the
peer gets ``nn.Linear`` copies whose rows are regrouped per rank first::

    ours (tp=1)      peer before Shard(0)        rank 0 after Shard(0)
    [q0 q1]          [q0 k0 v0 | q1 k1 v1]       [q0 k0 v0]   = what our own tp rank 0 holds
    [k0 k1]
    [v0 v1]          (qN: the N-th of t blocks of q's rows, i.e. heads N*hq/t .. (N+1)*hq/t)

and the attention module is told its local head counts, as torchtitan does. Everything else (RMSNorm, RoPE,
SDPA attention, SwiGLU) is our module's code, unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from modelpar.bench.torch_schedules import torch_v_class
from modelpar.model.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from modelpar.model.transformer import ModelChunk, build_chunk
from modelpar.optim import default_decay, lr_at
from modelpar.pipeline.schedule import V_SCHEDULES
from modelpar.training.config import TrainConfig

# schedules torch.distributed.pipelining has for ours (zbv and dualpipev: two stages per rank in a V)
PEER_SCHEDULES = ("gpipe", "1f1b", "interleaved", *V_SCHEDULES)


def peer_name(cfg: TrainConfig) -> str | None:
    """What the peer of this layout is, or None when there is none (zb-h1, sp, dp mixed with tp/pp, activation
    recompute, or an embedding tied across pipeline stages or tp ranks, which the peer does not synchronise;
    context parallelism: see ``torch_context_parallel_problem``)."""
    p = cfg.parallel
    if cfg.model.tie_embeddings and (p.pp > 1 or p.tp > 1) or p.recompute != "none" or p.cp > 1:
        return None
    parts = []
    if p.pp > 1:
        if p.schedule not in PEER_SCHEDULES:
            return None
        parts.append(f"torch.pipelining {p.schedule}")
    if p.tp > 1:
        if p.sp:
            return None
        parts.append("DTensor TP")
    if p.dp > 1:
        if p.tp > 1 or p.pp > 1:
            return None
        parts.append(f"FSDP2 fully_shard zero{cfg.optim.zero}" if fsdp_peer(cfg) else "DDP")
    return " + ".join(parts) or "torch eager"


def fsdp_peer(cfg: TrainConfig) -> bool:
    """Whether the peer shards with FSDP2 (pure dp at ZeRO-2/3) rather than replicating with DDP."""
    p = cfg.parallel
    return p.dp > 1 and p.tp == 1 and p.pp == 1 and cfg.optim.zero in (2, 3)


def torch_context_parallel_problem(device: torch.device) -> str:
    """Why PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``, ring
    attention under SDPA) is not raced: tried here on a tiny causal attention over the world as one cp mesh,
    the error it raises in one line, or that it ran (it is not wired as a peer of a whole training step)."""
    import torch.nn.functional as F

    try:
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
        x = torch.randn(1, 4 * dist.get_world_size(), 8, device=device)
        weight = torch.randn(24, 8, device=device, requires_grad=True)
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            q, k, v = (x @ weight.t()).unflatten(-1, (3, 1, 8)).unbind(2)
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            out.sum().backward()
    except Exception as exc:  # noqa: BLE001 - whatever it raises is the answer, reported rather than crashing the bench
        first_line = (str(exc).splitlines() or [""])[0]
        return f"torch context_parallel on {device.type}: {type(exc).__name__}: {first_line}"
    return f"torch context_parallel ran on {device.type} but is not raced as a whole training step"


# -- the model, re-expressed in nn.Linear / nn.Embedding -----------------------------------------------------


def regroup_rows(weight: torch.Tensor, part_rows: list[int], tp: int) -> torch.Tensor:
    """Rows of a fused ``[sum(part_rows), in]`` weight reordered so that ``Shard(0)`` over ``tp`` ranks gives
    rank r block r of every part: ``[p0; p1; ...] -> [p0_0; p1_0; ...; p0_1; p1_1; ...]``."""
    parts = weight.split(part_rows)
    return torch.cat([block for r in range(tp) for block in (p.chunk(tp)[r] for p in parts)])


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def torch_modules_copy(chunk: ModelChunk, tp: int) -> ModelChunk:
    """``chunk`` (tp=1) with every sharded layer swapped for an ``nn.Linear``/``nn.Embedding`` holding the same
    weights, fused ones regrouped for ``tp`` ranks (module docstring). Modifies and returns ``chunk``."""
    if chunk.tp.size != 1:
        raise ValueError("the peer starts from the single-device chunk (build_chunk with groups=None)")
    for block in chunk.layers.values():
        if block.half != "mlp":  # a block split between stages holds one half
            attn = block.self_attn
            qkv = attn.qkv_proj
            attn.qkv_proj = _linear(regroup_rows(qkv.weight.detach(), [p.rows for p in qkv.parts], tp))
            attn.o_proj = _linear(attn.o_proj.weight.detach())
            attn.heads //= tp
            attn.kv_heads //= tp
        if block.half != "attention":
            mlp = block.mlp
            gate_up = mlp.gate_up_proj
            mlp.gate_up_proj = _linear(regroup_rows(gate_up.weight.detach(), [p.rows for p in gate_up.parts], tp))
            mlp.down_proj = _linear(mlp.down_proj.weight.detach())
    if chunk.embed_tokens is not None:
        old = chunk.embed_tokens
        assert isinstance(old, VocabParallelEmbedding)
        chunk.embed_tokens = nn.Embedding(old.weight.shape[0], old.weight.shape[1])
        with torch.no_grad():
            chunk.embed_tokens.weight.copy_(old.weight)
    if chunk.lm_head is not None:
        assert isinstance(chunk.lm_head, ColumnParallelLinear)
        chunk.lm_head = _linear(chunk.lm_head.weight.detach())
        if chunk.config.tie_embeddings and chunk.embed_tokens is not None:
            chunk.lm_head.weight = chunk.embed_tokens.weight
    leftover = [n for n, m in chunk.named_modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    if leftover:
        raise RuntimeError(f"layers left unconverted: {leftover}")
    return chunk


def apply_tensor_parallel(chunk: ModelChunk, tp_mesh) -> None:
    """torchtitan's plan: embedding row-wise (vocab-parallel, all-reduce), q/k/v and gate/up column-wise,
    o and down row-wise, head column-wise with vocab-sharded logits for ``loss_parallel``."""
    plan = {}
    if chunk.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for i, block in chunk.layers.items():
        if block.half != "mlp":
            plan[f"layers.{i}.self_attn.qkv_proj"] = ColwiseParallel()
            plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        if block.half != "attention":
            plan[f"layers.{i}.mlp.gate_up_proj"] = ColwiseParallel()
            plan[f"layers.{i}.mlp.down_proj"] = RowwiseParallel()
    if chunk.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(chunk, tp_mesh, plan)


def dtensor_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of vocab-sharded DTensor logits [b, s, V/t] (call inside ``loss_parallel()``)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


# -- one rank's peer ------------------------------------------------------------------------------------------


class Peer:
    """This rank's part of the peer of ``cfg``'s layout; ``step(inputs, targets)`` trains one optimizer step.

    ``inputs``/``targets``: this dp replica's batch [B, s]. The step is forward and backward of ``m``
    micro-batches, global grad-norm clipping and AdamW (the same groups, betas, decay and LR schedule as ours).
    """

    def __init__(self, cfg: TrainConfig, transformer_cfg, partition, device: torch.device):
        p = cfg.parallel
        self.cfg, self.device = cfg, device
        self.m = p.microbatches
        self.rank = dist.get_rank()
        self.step_index = 0
        mesh = init_device_mesh(device.type, (p.dp, p.pp, p.tp), mesh_dim_names=("dp", "pp", "tp"))
        self.tp_mesh, self.pp_group = mesh["tp"], mesh["pp"].get_group()
        pp_rank = mesh["pp"].get_local_rank()
        self.tp_size = p.tp
        self.chunks = []
        for c in partition.chunks_of(pp_rank):
            chunk = build_chunk(
                transformer_cfg,
                None,
                partition.layers(c),
                first=partition.has_embedding(c),
                last=partition.has_head(c),
                split_blocks=partition.split_blocks(c),
                seed=cfg.trainer.seed,
                device=device,
            )
            if p.tp > 1:
                torch_modules_copy(chunk, p.tp)
                apply_tensor_parallel(chunk, self.tp_mesh)
            self.chunks.append(chunk)
        self.last = self.chunks[-1].last
        self.first = self.chunks[0].first
        self.loss_fn: Callable = dtensor_loss if p.tp > 1 else self.chunks[-1].loss
        self.ddp = self.fsdp = None
        self.dp_group = mesh["dp"].get_group() if p.dp > 1 else None
        if fsdp_peer(cfg):
            self.fsdp = self._fully_shard(self.chunks[0], mesh["dp"], reshard=cfg.optim.zero == 3)
        elif p.dp > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.chunks[0], process_group=self.dp_group)
        self.schedule = None
        if p.pp > 1:
            self.schedule = self._pipeline_schedule(p, partition, pp_rank)
        self.params = [(n, q) for chunk in self.chunks for n, q in chunk.named_parameters()]
        o = cfg.optim
        groups = [
            {"params": [q for n, q in self.params if default_decay(n, q) == wanted], "weight_decay": wd}
            for wanted, wd in ((True, o.weight_decay), (False, 0.0))
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)

    @staticmethod
    def _fully_shard(chunk: ModelChunk, dp_mesh, reshard: bool) -> ModelChunk:
        """FSDP2 as its users write it: each block, then the root (embedding, final norm, head)."""
        for block in chunk.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        return fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=reshard)

    def _pipeline_schedule(self, p, partition, pp_rank: int):
        stages = [
            PipelineStage(chunk, c, partition.n_chunks, self.device, group=self.pp_group)
            for chunk, c in zip(self.chunks, partition.chunks_of(pp_rank), strict=True)
        ]
        if p.schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, self.m, loss_fn=self.loss_fn)
        if p.schedule in V_SCHEDULES:
            return torch_v_class(p.schedule)(stages, self.m, loss_fn=self.loss_fn)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[p.schedule]
        return kind(stages[0], self.m, loss_fn=self.loss_fn)

    def _loss_context(self):
        if self.tp_size > 1:
            return loss_parallel()
        return contextlib.nullcontext()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on this replica's batch; returns the mean loss over micro-batches (every rank)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=self.device)
        with self._loss_context():
            if self.schedule is not None:
                losses: list[torch.Tensor] = []
                if self.first and self.last:
                    self.schedule.step(inputs, target=targets, losses=losses)
                elif self.first:
                    self.schedule.step(inputs)
                elif self.last:
                    self.schedule.step(target=targets, losses=losses)
                else:
                    self.schedule.step()
                if losses:
                    loss = torch.stack([_local_value(x).detach() for x in losses]).mean()
            else:
                loss = self._accumulate(inputs, targets)
        if self.schedule is not None:  # from the rank holding the head: the last, or the first under a V
            holder = 0 if self.cfg.parallel.schedule in V_SCHEDULES else dist.get_world_size(self.pp_group) - 1
            dist.broadcast(loss, src=dist.get_global_rank(self.pp_group, holder), group=self.pp_group)
        self._clip(self.cfg.optim.grad_clip)
        o, total = self.cfg.optim, self.cfg.trainer.steps
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_index, o.lr, o.warmup_steps, total, o.min_lr)
        self.optimizer.step()
        self.step_index += 1
        if self.dp_group is not None:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= dist.get_world_size(self.dp_group)
        return float(loss)

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """No pipeline: forward + backward of each micro-batch, DDP / FSDP2 syncing on the last one only
        (FSDP2 at ZeRO-2 also keeps the weights gathered until then)."""
        module = self.ddp if self.ddp is not None else self.chunks[0]
        total = torch.zeros((), device=self.device)
        pairs = list(zip(inputs.chunk(self.m), targets.chunk(self.m), strict=True))
        for j, (x, y) in enumerate(pairs):
            sync = j == len(pairs) - 1
            if self.fsdp is not None:
                self.fsdp.set_requires_gradient_sync(sync)
                if self.cfg.optim.zero == 2:
                    self.fsdp.set_reshard_after_backward(sync)
            with self.ddp.no_sync() if self.ddp is not None and not sync else contextlib.nullcontext():
                loss = self.loss_fn(module(x), y) / self.m
                loss.backward()
            total += _local_value(loss).detach()
        return total

    def _clip(self, max_norm: float) -> None:
        """Global grad-norm clipping: sharded DTensor grads summed over tp, replicated ones counted once."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for _, q in self.params:
            if q.grad is None:
                continue
            g = q.grad
            local = _local_value(g)
            weight = 1.0 if _is_sharded(g) else 1.0 / self.tp_size
            squares += weight * local.float().square().sum()
        if self.fsdp is not None:  # each dp rank holds its shard of every gradient
            dist.all_reduce(squares, group=self.dp_group)
        elif self.tp_size * dist.get_world_size(self.pp_group) > 1:  # dp > 1 only without tp and pp
            dist.all_reduce(squares)
        norm = math.sqrt(float(squares))
        coef = max_norm / (norm + 1e-6)
        if max_norm > 0 and coef < 1.0:
            for _, q in self.params:
                if q.grad is not None:
                    q.grad.mul_(coef)


def _local_value(x):
    return x.to_local() if hasattr(x, "to_local") else x


def _is_sharded(x) -> bool:
    placements = getattr(x, "placements", None)
    return placements is not None and any(pl.is_shard() for pl in placements)
