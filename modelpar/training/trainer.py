"""One rank of a training job: its model chunks, pipeline runtime, optimizer, data shard and checkpoints.

Every layout runs this same code; ``tp = pp = dp = 1`` is the single-device run. The step::

    batch (this dp replica's share of the global batch) -> m micro-batches -> pipeline runtime (F/B[/W])
      -> reduce tp-partial grads (sequence-parallel norms, replicated kv heads)
      -> sum tied-embedding grads over the embedding group (first + last stage)
      -> dp average (bucketed all-reduce) or ZeRO-1 reduce-scatter
      -> global grad norm (each parameter counted once), clip, LR schedule, AdamW
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from modelpar import backends
from modelpar.checkpoint.store import (
    Piece,
    latest_checkpoint,
    load_pieces,
    load_rank_state,
    read_index,
    save_checkpoint,
)
from modelpar.data import TokenFile, WindowSampler
from modelpar.model.flops import half_block_training_flops, head_training_flops, model_shape, training_flops_per_token
from modelpar.model.layers import ShardInfo
from modelpar.model.transformer import ModelChunk, TransformerConfig, build_chunk
from modelpar.optim import (
    GradientSynchronizer,
    ParamInfo,
    ZeroOneAdamW,
    build_adamw,
    clip_grad_norm,
    default_decay,
    load_optimizer_state_tensors,
    lr_at,
    optimizer_state_tensors,
    set_lr,
)
from modelpar.optim.state import MOMENTS
from modelpar.parallel import collectives
from modelpar.parallel.groups import ParallelGroups
from modelpar.pipeline import Partition, PipelineRuntime, build_schedule, partition_explicit, partition_uniform
from modelpar.pipeline.partition import partition_by_cost
from modelpar.training.config import TrainConfig
from modelpar.training.faults import fire, parse_faults
from modelpar.training.flight import FlightRecorder
from modelpar.training.health import HealthError, LossGuard, find_drift, find_stragglers


def transformer_config(cfg: TrainConfig) -> TransformerConfig:
    """The model's shape from the recipe (the recipe's ``model`` group adds only its ``name``)."""
    return TransformerConfig(**{f.name: getattr(cfg.model, f.name) for f in fields(TransformerConfig)})


def resolve_device(cfg: TrainConfig) -> torch.device:
    want = cfg.trainer.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The compute dtype of activations; parameters and optimizer state stay fp32 (master weights)."""
    if cfg.trainer.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.trainer.dtype]


def build_partition(cfg: TrainConfig) -> Partition:
    p, layers = cfg.parallel, cfg.model.layers
    if p.partition == "explicit":
        return partition_explicit(list(p.stage_layers), layers, p.pp, p.vpp)
    if p.partition == "params":
        shape = model_shape(cfg.model)
        embed = cfg.model.vocab_size * cfg.model.hidden
        return partition_by_cost([shape.block_params()] * layers, p.pp, p.vpp, embedding_cost=embed, head_cost=embed)
    if p.partition in ("flops", "blocks"):
        # training FLOPs per token of each half block (attention, MLP) against the last chunk's head and loss;
        # the embedding lookup is free. Balancing the head against blocks follows Narayanan et al. 2021 sec. 3.2;
        # cutting between a block's halves (flops) lets the stages even out where whole blocks (blocks) cannot.
        shape = model_shape(cfg.model)
        attention, mlp = half_block_training_flops(shape, cfg.data.seq_len)
        head = head_training_flops(shape)
        if p.partition == "blocks":
            return partition_by_cost([attention + mlp] * layers, p.pp, p.vpp, head_cost=head)
        return partition_by_cost([attention, mlp] * layers, p.pp, p.vpp, head_cost=head, halves=True)
    return partition_uniform(layers, p.pp, p.vpp)


@dataclass
class RankModel:
    """This rank's chunks and everything derived from them that a step needs."""

    chunks: list[ModelChunk]
    params: list[tuple[torch.nn.Parameter, ParamInfo]]
    tied: list[torch.nn.Parameter]  # this rank's copies of a tied embedding that lives on two stages


def build_rank_model(cfg: TrainConfig, groups: ParallelGroups, device: torch.device) -> RankModel:
    """Build this rank's chunks (layout-invariant init from ``trainer.seed``) and describe their parameters."""
    tcfg = transformer_config(cfg)
    partition = build_partition(cfg)
    chunks = [
        build_chunk(
            tcfg,
            groups,
            partition.layers(c),
            first=partition.has_embedding(c),
            last=partition.has_head(c),
            split_blocks=partition.split_blocks(c),
            seed=cfg.trainer.seed,
            sequence_parallel=cfg.parallel.sp,
            recompute=cfg.parallel.recompute,
            device=device,
        )
        for c in partition.chunks_of(groups.pp_rank)
    ]
    tied_across_stages = tcfg.tie_embeddings and groups.layout.pp > 1
    params: list[tuple[torch.nn.Parameter, ParamInfo]] = []
    tied: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for chunk in chunks:
        shards = chunk.logical_shards()
        for name, param in chunk.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            logical = [(n, s) for n, s in shards.items() if s.param is param]
            share = _norm_share(param, logical)
            if tied_across_stages and any(n == "embed_tokens.weight" for n, _ in logical):
                tied.append(param)
                if not chunk.first:
                    share = 0.0  # the first stage counts the tied weight; this is its copy
            info = ParamInfo(name=f"{_chunk_name(chunk)}.{name}", decay=default_decay(name, param), norm_share=share)
            params.append((param, info))
    return RankModel(chunks, params, tied)


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


# -- checkpoint mapping -----------------------------------------------------------------------------------


def model_pieces(chunks: list[ModelChunk]) -> dict[Piece, torch.Tensor]:
    """This rank's regions of every logical tensor, for ``save_checkpoint``."""
    return {piece: shard.tensor for piece, shard in _pieces_and_shards(chunks)}


def optimizer_pieces(chunks: list[ModelChunk], optimizer) -> tuple[dict[Piece, torch.Tensor], float | None]:
    """This rank's regions of the Adam moments of every logical tensor, named ``<moment>/<tensor name>`` (the
    layout-free form of the optimizer state), and torch's AdamW step count; ``({}, None)`` before the first
    step or when parameters disagree on it. Collective over dp under ZeRO-1 (the moments are gathered)."""
    if isinstance(optimizer, ZeroOneAdamW):
        gathered = optimizer.full_moments(MOMENTS)
        if gathered is None:
            return {}, None
        per_param, step = gathered
        state_of = {id(p): state for p, state in zip(optimizer.params, per_param, strict=True)}
    else:
        state_of = {id(p): st for p, st in optimizer.state.items()}
        steps = {float(st["step"]) for st in state_of.values()}
        if len(steps) != 1:
            return {}, None
        step = steps.pop()
    pieces = {}
    for piece, shard in _pieces_and_shards(chunks):
        state = state_of.get(id(shard.param))
        if not state:
            continue
        for kind in MOMENTS:
            moment = state[kind].detach()[shard.local_rows]
            pieces[Piece(f"{kind}/{piece.name}", piece.global_shape, piece.region)] = moment
    return pieces, step


def _pieces_and_shards(chunks: list[ModelChunk]):
    for chunk in chunks:
        for name, shard in chunk.logical_shards().items():
            region = tuple(
                (sl.start or 0, n if sl.stop is None else sl.stop)
                for sl, n in zip(shard.index, shard.global_shape, strict=True)
            )
            yield Piece(name, tuple(shard.global_shape), region), shard


def _moment_regions(chunks: list[ModelChunk]) -> dict[Piece, tuple[str, ShardInfo]]:
    return {
        Piece(f"{kind}/{piece.name}", piece.global_shape, piece.region): (kind, shard)
        for piece, shard in _pieces_and_shards(chunks)
        for kind in MOMENTS
    }


def load_optimizer_pieces(chunks: list[ModelChunk], ckpt: Path, index: dict) -> dict[Piece, torch.Tensor]:
    """The regions of the saved logical Adam moments that ``chunks`` (this rank, any layout) hold."""
    return load_pieces(ckpt, index, list(_moment_regions(chunks)), table="optimizer_tensors")


def resharded_optimizer_state(model: RankModel, ckpt: Path, index: dict, step: float) -> dict[str, torch.Tensor]:
    """This rank's optimizer state rebuilt from a checkpoint's logical moments (any layout that saved them),
    keyed as ``load_optimizer_state_tensors`` takes it: whole local parameters, which ZeRO-1 slices itself."""
    wanted = _moment_regions(model.chunks)
    loaded = load_pieces(ckpt, index, list(wanted), table="optimizer_tensors")
    moments: dict[tuple[str, int], torch.Tensor] = {}
    for key, (kind, shard) in wanted.items():
        full = moments.setdefault((kind, id(shard.param)), torch.zeros_like(shard.param, device="cpu"))
        full[shard.local_rows] = loaded[key].to(full.dtype)
    out = {}
    for param, info in model.params:
        if ("exp_avg", id(param)) in moments:
            for kind in MOMENTS:
                out[f"{kind}/{info.name}"] = moments[kind, id(param)]
            out[f"step/{info.name}"] = torch.tensor(step, dtype=torch.float32)
    return out


def load_model_from_checkpoint(chunks: list[ModelChunk], ckpt: Path, index: dict) -> None:
    """Load every logical tensor region this rank holds, whatever layout wrote the checkpoint."""
    wanted = model_pieces(chunks)
    loaded = load_pieces(ckpt, index, list(wanted))
    with torch.no_grad():
        for piece, target in wanted.items():
            target.copy_(loaded[piece])


# -- the training loop ------------------------------------------------------------------------------------


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_time_s: float
    mfu: float | None
    skipped: str | None = None  # why the update was not applied (non-finite, spike), else None
    skipped_total: int = 0
    stragglers: list[int] | None = None  # ranks named slow at this step's check
    drift: list[str] | None = None  # parameters found differing at this step's check


class Trainer:
    """Owns one rank's state for a run; ``fit()`` trains ``trainer.steps`` steps."""

    def __init__(self, cfg: TrainConfig, data_path: str, resume_from: str | None):
        self.cfg = cfg
        self.layout = cfg.parallel.layout()
        self.groups = ParallelGroups.build(self.layout)
        self.rank = dist.get_rank()
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        torch.manual_seed(cfg.trainer.seed)
        self.model = build_rank_model(cfg, self.groups, self.device)
        self.micro_batches = cfg.parallel.microbatches
        self.local_batch = cfg.data.global_batch // self.layout.dp
        self.micro_batch_size = self.local_batch // self.micro_batches
        first, last = self.model.chunks[0], self.model.chunks[-1]
        schedule = build_schedule(cfg.parallel.schedule, self.layout.pp, self.micro_batches, self.layout.vpp)
        self.runtime = PipelineRuntime(
            self.model.chunks,
            self.groups,
            schedule,
            activation_shape=first.activation_shape(self.micro_batch_size, cfg.data.seq_len),
            loss_fn=last.loss if last.last else _no_loss,
            dtype=torch.float32,
            device=self.device,
        )
        o = cfg.optim
        adam = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        if o.zero:
            self.optimizer = ZeroOneAdamW(self.model.params, self.groups.dp_group, **adam)
            self.sync = None
        else:
            self.optimizer = build_adamw(self.model.params, **adam)
            self.sync = GradientSynchronizer(
                [p for p, _ in self.model.params], self.groups.dp_group, bucket_bytes=int(o.bucket_mb * 2**20)
            )
        self.tokens = TokenFile.open(data_path, cfg.model.vocab_size, cfg.data.seq_len)
        self.sampler = WindowSampler(
            self.tokens.num_windows, cfg.data.global_batch, self.groups.dp_rank, self.layout.dp, cfg.data.seed
        )
        self.step = 0
        self.out_dir = Path(cfg.trainer.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self.flops_per_step = training_flops_per_token(model_shape(cfg.model), cfg.data.seq_len) * (
            cfg.data.global_batch * cfg.data.seq_len
        )
        t = cfg.trainer
        self.guard = LossGuard(t.nonfinite, t.spike_factor, t.spike_action)
        self.faults = parse_faults()
        g = self.groups
        self.flight = FlightRecorder(
            self.out_dir / "flight", self.rank, f"pp {g.pp_rank} tp {g.tp_rank} dp {g.dp_rank}"
        )
        self.runtime.observer = self.flight
        collectives.set_collective_observer(self.flight)
        self._compute_s = 0.0
        self.last_result = None  # the runtime's StepResult of the latest step (per-action times, peak in flight)
        if self.faults:
            for chunk in self.model.chunks:
                chunk.register_forward_pre_hook(self._forward_faults)
        # the transport's own tuning (gloo on CPU: exchange collectives, the tp socket thread at idle priority)
        self.tuning = backends.install(
            self.groups, self.device, collectives=cfg.parallel.collectives, gloo_threads=cfg.trainer.gloo_threads
        )
        self.idle_threads = self.tuning.idle_threads
        if resume_from:
            self.resume(Path(resume_from))

    def _forward_faults(self, module, args) -> None:
        for kind in ("sleep", "kill", "delay"):
            fire(self.faults, kind, self.rank, self.step)

    # -- one step ------------------------------------------------------------------------------------------

    def train_step(self) -> StepMetrics:
        cfg = self.cfg
        start = time.perf_counter()
        indices = self.sampler.next_batch()
        inputs, targets = self.tokens.batch(indices)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        micro_inputs = list(inputs.chunk(self.micro_batches))
        micro_targets = list(targets.chunk(self.micro_batches))
        for p, _ in self.model.params:
            p.grad = None
        if self.sync is not None:
            self.sync.expect_micro_batches(self.micro_batches)  # buckets all-reduce during the last backward
        self.flight.step = self.step
        with self._autocast():
            result = self.last_result = self.runtime.step(micro_inputs, micro_targets)
        if self.step + 1 == cfg.trainer.timeline_step:
            self._draw_timeline(result)
        self._compute_s = sum(r.end - r.start for r in result.records if r.action.kind.is_compute)
        if self.sync is not None:
            self.sync.wait()
        # tp and tied-embedding reductions are sums, so they commute with the dp average; after it, because
        # the overlapped buckets copied the gradients when they launched.
        for chunk in self.model.chunks:
            chunk.reduce_tensor_parallel_grads()
        self._sync_tied_embedding()
        if self.sync is not None:
            norm = clip_grad_norm(self.model.params, cfg.optim.grad_clip, self.groups)
        else:
            self.optimizer.reduce_gradients()
            norm = clip_grad_norm(
                self.optimizer.shard_params_with_info(), cfg.optim.grad_clip, self.groups, zero_sharded=True
            )
        lr = lr_at(self.step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.trainer.steps, cfg.optim.min_lr)
        set_lr(self.optimizer, lr)
        loss = self._dp_mean(result.loss)
        if fire(self.faults, "nan", self.rank, self.step):
            loss = math.nan  # as if this rank's batch were poisoned
        loss, norm = self._agree_on_nonfinite(loss, norm)
        skipped = self.guard.check(self.step, loss, norm)  # same inputs on every rank: the same decision
        if skipped is None:
            self.optimizer.step()
        self.optimizer.zero_grad()
        if fire(self.faults, "perturb", self.rank, self.step):
            with torch.no_grad():
                self.model.params[0][0].add_(1e-3)
        self.step += 1
        stragglers = drift = None
        if cfg.trainer.check_every and self.step % cfg.trainer.check_every == 0:
            stragglers, drift = self.check_health()
        elapsed = time.perf_counter() - start
        tokens = cfg.data.global_batch * cfg.data.seq_len
        peak = cfg.trainer.peak_tflops * 1e12 * self.layout.world_size
        return StepMetrics(
            step=self.step,
            loss=loss,
            lr=lr,
            grad_norm=norm,
            tokens_per_s=tokens / elapsed,
            step_time_s=elapsed,
            mfu=(self.flops_per_step / elapsed / peak) if peak > 0 else None,
            skipped=skipped,
            skipped_total=self.guard.skipped,
            stragglers=stragglers,
            drift=drift,
        )

    def check_health(self) -> tuple[list[int], list[str]]:
        """Straggler and replica-drift checks (collective over the world); logs on rank 0, may halt."""
        slow, times = find_stragglers(self._compute_s, self.cfg.trainer.straggler_factor)
        drift = self._find_drift()
        if self.rank == 0 and slow:
            listing = ", ".join(f"rank {r}: {times[r] * 1e3:.1f} ms" for r in slow)
            median = sorted(times)[len(times) // 2]
            print(f"modelpar-train: straggler at step {self.step}: {listing} (median {median * 1e3:.1f} ms)")
        if drift:
            message = f"replica drift at step {self.step} (seen by rank {self.rank}): " + "; ".join(drift)
            if self.cfg.trainer.drift_action == "halt":
                raise HealthError(message + "; halting (trainer.drift_action=halt)")
            print(f"modelpar-train: {message}", flush=True)
        return slow, drift

    def _find_drift(self) -> list[str]:
        """Values that must agree: everything across dp replicas, tp-replicated rows, the tied embedding."""
        g = self.groups
        named = [(info.name, p) for p, info in self.model.params]
        problems = find_drift(named, g.dp_group, list(g.dp_ranks))
        replicated = []
        for chunk in self.model.chunks:
            for name, shard in chunk.logical_shards().items():
                if shard.replicated_over_tp:
                    replicated.append((name, shard.tensor))
        problems += find_drift(replicated, g.tp_group, list(g.tp_ranks))
        if self.model.tied and g.embedding_group is not None:
            problems += find_drift(
                [("embed_tokens.weight", self.model.tied[0])], g.embedding_group, list(g.embedding_ranks)
            )
        return problems

    def _sync_tied_embedding(self) -> None:
        """The embedding on the first stage and its copy on the last stage get the sum of both gradients."""
        if not self.model.tied:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.tied]
        flat = torch.cat([g.flatten() for g in grads])
        with collectives.comm_tag("tied_embedding"):
            collectives.all_reduce(flat, self.groups.embedding_group)
        for p, piece in zip(self.model.tied, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = piece.view_as(p).clone()

    def _autocast(self):
        """bf16 compute over fp32 master weights: parameters, gradients and optimizer state stay fp32."""
        if self.dtype == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _draw_timeline(self, result) -> None:
        """The measured timeline of this step across pipeline stages (tp/dp rank 0 of each), as a PNG."""
        from modelpar.pipeline import measured_timeline
        from modelpar.pipeline.gantt import render_png

        g = self.groups
        gathered: list = [None] * self.layout.pp
        dist.all_gather_object(gathered, result, group=g.pp_group)
        if self.rank == 0:
            path = self.out_dir / "timeline.png"
            title = f"{self.layout} {self.cfg.parallel.schedule}, m={self.micro_batches}, step {self.step + 1}"
            render_png(measured_timeline(gathered), str(path), title=title)

    def _agree_on_nonfinite(self, loss: float, norm: float) -> tuple[float, float]:
        """One tiny all-reduce so that a NaN/Inf seen by any rank is seen by all, and all skip together."""
        bad = torch.tensor([0.0 if math.isfinite(loss) and math.isfinite(norm) else 1.0], device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() and math.isfinite(loss) and math.isfinite(norm):
            return math.nan, norm
        return loss, norm

    def _dp_mean(self, value: float) -> float:
        if self.layout.dp == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.groups.dp_group)
        return t.item() / self.layout.dp

    # -- checkpoints ---------------------------------------------------------------------------------------

    def save(self) -> Path:
        """Collective. The Adam moments are saved as logical pieces (``optim-*.safetensors``), which any layout,
        ZeRO-1 or not, reloads: the same layout bit for bit."""
        meta = {
            "layout": asdict(self.layout),
            "sampler": self.sampler.state_dict(),
            "model": asdict(self.cfg.model),
            "parallel": asdict(self.cfg.parallel),
            "world_size": self.layout.world_size,
        }
        optim_state = optimizer_state_tensors(self.optimizer)
        moments, optimizer_step = optimizer_pieces(self.model.chunks, self.optimizer)
        if moments:
            # the moments go to optim-*.safetensors; ZeRO-1's fp32 masters equal the (fp32) parameters
            meta["optimizer_step"] = optimizer_step  # torch's AdamW step count, the same for every parameter
            optim_state = {}
        rank_state = {f"optim/{k}": v for k, v in optim_state.items()}
        rank_state["rng/torch"] = torch.get_rng_state()
        rank_state = _crash_midway(rank_state, self.faults, self.rank, self.step)
        pieces = model_pieces(self.model.chunks)
        return save_checkpoint(
            self.ckpt_root, self.step, pieces, rank_state, meta, self.cfg.trainer.keep_last, optimizer=moments
        )

    def resume(self, ckpt: Path) -> None:
        index = read_index(ckpt)
        load_model_from_checkpoint(self.model.chunks, ckpt, index)
        self.step = int(index["step"])
        if index.get("sampler"):
            self.sampler.load_state_dict(index["sampler"])
        same_layout = index["layout"] == asdict(self.layout)
        state = load_rank_state(ckpt, self.rank) if same_layout else {}
        optim = {k.removeprefix("optim/"): v for k, v in state.items() if k.startswith("optim/")}
        if "rng/torch" in state:
            torch.set_rng_state(state["rng/torch"])
        if "optimizer_tensors" in index and "optimizer_step" in index:
            state = resharded_optimizer_state(self.model, ckpt, index, index["optimizer_step"])
            load_optimizer_state_tensors(self.optimizer, state)
            if self.rank == 0 and not same_layout:
                print(
                    f"modelpar-train: {ckpt} was saved with layout {index['layout']}; weights, data position and "
                    f"Adam moments are resharded to {asdict(self.layout)}",
                    flush=True,
                )
        elif optim and index.get("optimizer", True):  # per-rank state (checkpoints from before the logical one)
            load_optimizer_state_tensors(self.optimizer, optim)
        elif self.rank == 0:
            print(
                f"modelpar-train: {ckpt} holds no optimizer state for layout {asdict(self.layout)} (saved with "
                f"{index['layout']}, before any optimizer step); weights and data position are loaded, the optimizer "
                "starts fresh",
                flush=True,
            )

    # -- the loop ------------------------------------------------------------------------------------------

    def fit(self) -> None:
        cfg = self.cfg.trainer
        is_logger = self.rank == 0
        metrics_path = self.out_dir / "metrics.jsonl"
        board = _tensorboard(self.out_dir) if is_logger and cfg.tensorboard else None
        progress = _progress(cfg.steps, self.step) if is_logger and cfg.progress else None
        with open(metrics_path, "a") if is_logger else contextlib.nullcontext() as log:
            while self.step < cfg.steps:
                m = self.train_step()
                if is_logger:
                    log.write(json.dumps(asdict(m)) + "\n")
                    log.flush()
                    if board is not None:
                        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                            if getattr(m, key) is not None:
                                board.add_scalar(f"train/{key}", getattr(m, key), m.step)
                    if progress is not None:
                        progress.set_postfix(_postfix(m), refresh=False)
                        progress.update(1)
                    elif m.step % cfg.log_every == 0 or m.step == cfg.steps:
                        print(_line(m), flush=True)
                if cfg.ckpt_every and (self.step % cfg.ckpt_every == 0 or self.step == cfg.steps):
                    self.save()
        if progress is not None:
            progress.close()
        if board is not None:
            board.close()
        collectives.set_collective_observer(None)
        self.flight.close()
        self.tuning.close()


def _crash_midway(state: dict, faults, rank: int, step: int):
    """The rank's state, wrapped so that the save dies after its model file is written and before the rest."""
    if not any(f.kind == "save_crash" and f.rank == rank and f.step == step for f in faults):
        return state

    class Crashing(Mapping):
        def __getitem__(self, key):
            return state[key]

        def __iter__(self):
            fire(faults, "save_crash", rank, step)
            return iter(state)

        def __len__(self):
            return len(state)

    return Crashing()


def _no_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the loss runs on the last pipeline stage only")


def _postfix(m: StepMetrics) -> dict[str, str]:
    out = {"loss": f"{m.loss:.4f}", "lr": f"{m.lr:.2e}", "tok/s": f"{m.tokens_per_s:,.0f}"}
    if m.mfu is not None:
        out["mfu"] = f"{100 * m.mfu:.1f}%"
    return out


def _line(m: StepMetrics) -> str:
    return f"step {m.step:6d} " + " ".join(f"{k} {v}" for k, v in _postfix(m).items())


def _tensorboard(out_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeError("trainer.tensorboard=true needs the tensorboard package: pip install tensorboard") from exc
    return SummaryWriter(str(out_dir / "tensorboard"))


def _progress(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def train_worker(cfg: TrainConfig, data_path: str, resume_from: str | None) -> None:
    """Entry point of every rank (after the process group is initialised)."""
    torch.manual_seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed)
    Trainer(cfg, data_path, resume_from).fit()


__all__ = ["Trainer", "build_rank_model", "latest_checkpoint", "train_worker", "transformer_config"]
