"""One rank of a training job over its run: build it, loop over steps, log, check health, checkpoint.

The pieces live beside this file, one idea each: ``build`` (model, runtime, optimizer, data), ``step`` (one
optimizer step, one host sync), ``sinks`` (where metrics go), ``health`` and ``flight`` (guards, stragglers,
drift, hang reports), ``faults`` (injected from outside, only when ``MODELPAR_FAULTS`` is set).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from modelpar import backends
from modelpar.checkpoint.async_save import AsyncCheckpointer
from modelpar.checkpoint.reshard import (
    load_model_from_checkpoint,
    model_pieces,
    optimizer_pieces,
    resharded_optimizer_state,
)
from modelpar.checkpoint.save import CheckpointSaveError, prepare_save, save_checkpoint
from modelpar.checkpoint.signing import load_key, read_signed_index, sign_checkpoint
from modelpar.checkpoint.store import CheckpointError, load_rank_state, read_index
from modelpar.data import DataError, tokenizer_spec
from modelpar.data.fingerprint import check_same_data, data_source, fingerprint
from modelpar.model.flops import training_flops_per_token
from modelpar.optim.fsdp import local
from modelpar.parallel import collectives
from modelpar.parallel.groups import ParallelGroups
from modelpar.pipeline import StepResult, measured_timeline
from modelpar.pipeline.gantt import render_png
from modelpar.training import faults
from modelpar.training.build import (
    build_data,
    build_rank_model,
    build_rank_optimizer,
    build_runtime,
    resolve_device,
)
from modelpar.training.config import TrainConfig
from modelpar.training.flight import FlightRecorder
from modelpar.training.health import HealthError, LossGuard, find_drift, find_stragglers
from modelpar.training.init_from import init_source, load_initial_weights
from modelpar.training.interrupt import StopRequest
from modelpar.training.moe_stats import MoEStatistics
from modelpar.training.plugins import (
    GradientFlags,
    GradientOutliers,
    MoEStats,
    MTPStats,
    SilentCorruption,
    StepPlugin,
)
from modelpar.training.profile import StepProfiler
from modelpar.training.qk_clip import QKClip
from modelpar.training.sdc import SilentCorruptionCheck
from modelpar.training.sinks import open_sinks
from modelpar.training.step import StepMetrics, TrainStep


class Trainer:
    """Owns one rank's state for a run; ``fit()`` trains ``trainer.steps`` steps.

    ``resume_verified``: the launcher already checked the checkpoint's hashes, so loading does not hash it again.
    """

    def __init__(self, cfg: TrainConfig, data_path: str, resume_from: str | None, *, resume_verified: bool = False):
        self.cfg = cfg
        self.layout = cfg.parallel.layout()
        self.groups = g = ParallelGroups.build(self.layout)
        self.rank = dist.get_rank()
        self.device = resolve_device(cfg)
        if cfg.trainer.sdc_check_every and self.device.type == "cuda":  # a rerun must repeat every bit
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        # the transport's own tuning (gloo on CPU: exchange collectives, the tp socket thread at idle priority)
        self.tuning = backends.install(
            g, self.device, collectives=cfg.parallel.collectives, gloo_threads=cfg.trainer.gloo_threads
        )
        self.idle_threads = self.tuning.idle_threads
        torch.manual_seed(cfg.trainer.seed)
        self.model = build_rank_model(cfg, g, self.device)
        self.dtype = self.model.dtype  # of activations; resolved once, by the model build
        self.runtime = build_runtime(cfg, self.model, g, self.device, self.dtype)
        self.optimizer = build_rank_optimizer(cfg, self.model, g)
        for hook in ("before_backward", "before_weight_backward", "after_weight_backward"):  # FSDP2's
            setattr(self.runtime, hook, getattr(self.optimizer, hook, None))
        self.runtime.overlap_pairs = cfg.parallel.overlap_pairs
        if getattr(self.optimizer, "frees_weights_inside_a_step", False):
            # a pair through one chunk could free what its other side still reads: such pairs run in order;
            # pairs through the rank's two chunks (two FSDP2 roots, disjoint weights) still run at once
            self.runtime.pairs = frozenset(p for p in self.runtime.pairs if p[0].chunk != p[1].chunk)
        self.tokens, self.sampler = build_data(cfg, data_path, g)
        self.data_path = data_path
        self.micro_batches = cfg.parallel.microbatches
        self.step = 0
        self.out_dir = Path(cfg.trainer.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self.signing_key = load_key(cfg.trainer.signing_key or None)
        t = cfg.trainer
        self.guard = LossGuard(t.nonfinite, t.spike_factor, t.spike_action)
        self.flight = FlightRecorder(
            self.out_dir / "flight",
            self.rank,
            f"pp {g.pp_rank} tp {g.tp_rank} dp {g.dp_rank}" + (f" cp {g.cp_rank}" if self.layout.cp > 1 else ""),
        )
        self.runtime.observer = self.flight
        collectives.set_collective_observer(self.flight)
        self.faults = faults.install(self.model.chunks, self.rank, [p for p, _ in self.model.params])
        self.async_ckpt = AsyncCheckpointer() if cfg.trainer.ckpt_async else None
        self._ckpt_report: dict | None = None
        flops = training_flops_per_token(cfg.model, cfg.data.seq_len) * cfg.data.global_batch
        self.train_one = TrainStep(
            cfg=cfg,
            groups=g,
            model=self.model,
            runtime=self.runtime,
            optimizer=self.optimizer,
            tokens=self.tokens,
            sampler=self.sampler,
            device=self.device,
            dtype=self.dtype,
            guard=self.guard,
            flops_per_step=flops * cfg.data.seq_len,
            plugins=tuple(self._step_plugins()),
            fence=self._fence if self.async_ckpt is not None else None,
        )
        if resume_from:
            self.resume(Path(resume_from), verified=resume_verified)
        elif cfg.trainer.init_from:  # a fresh run from another model's weights; preflight verified them
            load_initial_weights(self.model.chunks, init_source(cfg.trainer.init_from, verify=False))

    # -- one step ------------------------------------------------------------------------------------------

    def _step_plugins(self) -> list[StepPlugin]:
        """The step's optional features the recipe turns on, in the order the step calls them."""
        cfg, t, g = self.cfg, self.cfg.trainer, self.groups
        params = [p for p, _ in self.model.params]
        plugins: list[StepPlugin] = [GradientFlags(self.optimizer)]
        moe = MoEStats(MoEStatistics(self.model.chunks, g), self.device) if cfg.model.moe.enabled else None
        plugins += [moe] if moe is not None else []
        if cfg.model.mtp_depth:
            plugins.append(MTPStats(self.model.chunks, g, cfg.model.mtp_depth, self.device))
        # under ZeRO-2/3 gradients are reduced inside backward: nothing to compare before
        if t.grad_outlier_action != "off" and self.layout.dp >= 2 and cfg.optim.zero < 2:
            plugins.append(GradientOutliers(self.optimizer, g, t.grad_outlier_cosine, t.grad_outlier_norm))
        if t.sdc_check_every:
            rerun = build_runtime(cfg, self.model, g, self.device, self.dtype, rerun=True)
            rerun.observer = self.flight
            check = SilentCorruptionCheck(self.model.chunks, params, g, self.runtime, rerun)
            plugins.append(SilentCorruption(check, t.sdc_check_every, moe))
        plugins += [self.faults] if self.faults is not None else []
        if cfg.optim.qk_clip:  # after the faults: rescales the weights the update left
            plugins.append(QKClip(self.model.chunks, g, cfg.optim.qk_clip, self.optimizer))
        return plugins

    def train_step(self) -> StepMetrics:
        """One optimizer step; on check steps also times the actions and runs the straggler and drift checks."""
        t = self.cfg.trainer
        checking = bool(t.check_every) and (self.step + 1) % t.check_every == 0
        timeline = self.step + 1 == t.timeline_step
        bench_timing = self.runtime.timing  # a benchmark may have turned per-action records on for every step
        self.runtime.timing = bench_timing or checking or timeline
        self.flight.step = self.step  # hang reports name the step
        try:
            metrics, result = self.train_one(self.step)
        finally:
            self.runtime.timing = bench_timing
        if timeline:
            self._draw_timeline(result)
        self.step += 1
        if checking:
            stragglers, drift = self.check_health(result)
            metrics = replace(metrics, stragglers=stragglers, drift=drift)
        return metrics

    def check_health(self, result: StepResult) -> tuple[list[int], list[str]]:
        """Straggler and replica-drift checks (collective over the world); logs on rank 0, may halt."""
        compute_s = sum(r.end - r.start for r in result.records if r.action.kind.is_compute)
        slow, times = find_stragglers(compute_s, self.cfg.trainer.straggler_factor)
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
        # dp replicas hold different shards by design: only tp compares (experts too: under ep they are sharded
        # over the ranks holding them, or held by one rank alone; hybrid sharding with ep is refused)
        sharded = self.cfg.optim.zero >= 2
        named = [(info.name, p) for p, info in self.model.params if not info.expert_parallel]
        problems = [] if sharded else find_drift(named, g.dp_group, list(g.dp_ranks))
        experts = [(info.name, p) for p, info in self.model.params if info.expert_parallel]
        if experts and not sharded:  # each ep rank holds other experts: compare the ranks holding the same ones
            problems += find_drift(experts, g.expert_dp_group, list(g.expert_dp_ranks))
        replicated = []
        for chunk in self.model.chunks:
            for name, shard in chunk.logical_shards().items():
                if shard.replicated_over_tp:  # under ZeRO-2/3: the rows of this dp shard, the same on each tp rank
                    piece = shard.piece_of(shard.param.detach())
                    if piece is not None:
                        replicated.append((name, piece[0]))
        problems += find_drift(replicated, g.tp_group, list(g.tp_ranks))
        if self.model.tied and g.embedding_group is not None:
            problems += find_drift(
                [("embed_tokens.weight", local(self.model.tied[0].detach()))],
                g.embedding_group,
                list(g.embedding_ranks),
            )
        return problems

    def _draw_timeline(self, result: StepResult) -> None:
        """The measured timeline of this step across pipeline stages (tp/dp rank 0 of each), as a PNG."""
        gathered: list = [None] * self.layout.pp
        dist.all_gather_object(gathered, result, group=self.groups.pp_group)
        if self.rank == 0:
            path = self.out_dir / "timeline.png"
            title = f"{self.layout} {self.cfg.parallel.schedule}, m={self.micro_batches}, step {self.step + 1}"
            render_png(measured_timeline(gathered), str(path), title=title)

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
            "data_fingerprint": fingerprint(self.data_path) if self.rank == 0 else None,  # rank 0 writes the index
            "data": data_source(self.data_path),  # what modelpar-eval scores unless told otherwise
            "tokenizer": tokenizer_spec(self.data_path)
            if self.rank == 0
            else None,  # what modelpar-generate decodes with
        }
        moments, optimizer_step = optimizer_pieces(self.model.chunks, self.optimizer)
        if moments:
            # the moments go to optim-*.safetensors; ZeRO-1's fp32 masters equal the (fp32) parameters
            meta["optimizer_step"] = optimizer_step  # torch's AdamW step count, the same for every parameter
            optim_state = {}
        else:  # a CPU copy of the whole state (before the first step: small), only when it is written
            optim_state = self.optimizer.state_tensors()
        rank_state = {f"optim/{k}": v for k, v in optim_state.items()}
        rank_state["rng/torch"] = torch.get_rng_state()
        if self.faults and self.async_ckpt is None:
            rank_state = self.faults.rank_state(self.step, rank_state)
        pieces = model_pieces(self.model.chunks)
        sign = functools.partial(sign_checkpoint, key=self.signing_key) if self.signing_key else None
        if self.async_ckpt is not None:
            return self._save_async(pieces, rank_state, meta, moments, sign)
        return save_checkpoint(
            self.ckpt_root,
            self.step,
            pieces,
            rank_state,
            meta,
            self.cfg.trainer.keep_last,
            optimizer=moments,
            sign=sign,
        )

    def _save_async(self, pieces, rank_state, meta, moments, sign) -> None:
        """Collective: finish the save in flight (at most one), then snapshot this one and start its writer."""
        began = time.perf_counter()
        self.finish_async_save()
        keep = self.cfg.trainer.keep_last
        pending = prepare_save(self.ckpt_root, self.step, pieces, rank_state, meta, keep, optimizer=moments, sign=sign)
        step = self.step
        wrap = (lambda state: self.faults.rank_state(step, state)) if self.faults else None
        self.async_ckpt.start(pending, wrap_state=wrap)
        self._ckpt_report = {"step": step, "stall_s": time.perf_counter() - began}
        return None

    def _fence(self) -> None:
        """Before the step's update: wait for the save in flight to copy the weights and moments (the wait,
        if any, is reported with that save under ``checkpoint``)."""
        waited = self.async_ckpt.wait_snapshot()
        if waited > 0 and self._ckpt_report is not None:
            self._ckpt_report["fence_s"] = waited

    def finish_async_save(self) -> Path | None:
        """Collective: wait for the background writer and publish its checkpoint (no-op when none is in
        flight); its wait is reported in the next step's metrics under ``checkpoint``."""
        if self.async_ckpt is None or self.async_ckpt.in_flight is None:
            return None
        path, waited = self.async_ckpt.finish()
        self._ckpt_report = {**(self._ckpt_report or {}), "wait_s": waited, "published": path.name}
        return path

    def save_or_report(self, finish: bool = False) -> Path | None:
        """``save()`` (or, with ``finish``, the finish of an asynchronous one); a save that failed (the same
        error on every rank, ``latest`` untouched) halts or is reported in one line and training goes on
        (``trainer.save_error``)."""
        try:
            return self.finish_async_save() if finish else self.save()
        except CheckpointSaveError as exc:
            if self.cfg.trainer.save_error == "halt":
                raise CheckpointSaveError(f"{exc}; halting (trainer.save_error=halt)") from None
            if self.rank == 0:
                print(f"modelpar-train: {exc}; training goes on (trainer.save_error=continue)", flush=True)
            return None

    def resume(self, ckpt: Path, *, verified: bool = False) -> None:
        """Load weights, data position and optimizer state from ``ckpt``, whatever layout saved it.

        Unless ``verified``, rank 0 checks every file's hash once and tells the others the verdict."""
        index = read_index(ckpt, verify=False)
        if not verified:
            self._verify_once(ckpt, index)  # hashes, signature and the data's fingerprint
        load_model_from_checkpoint(self.model.chunks, ckpt, index)
        self.step = int(index["step"])
        if index.get("sampler"):
            self.sampler.load_state_dict(index["sampler"])
        same_layout = {"cp": 1, **index["layout"]} == asdict(self.layout)  # saved before cp existed: cp=1
        state = load_rank_state(ckpt, self.rank) if same_layout else {}
        optim = {k.removeprefix("optim/"): v for k, v in state.items() if k.startswith("optim/")}
        if "rng/torch" in state:
            torch.set_rng_state(state["rng/torch"])
        if "optimizer_tensors" in index and "optimizer_step" in index:
            state = resharded_optimizer_state(
                self.model.chunks,
                self.model.params,
                ckpt,
                index,
                index["optimizer_step"],
                muon=self.optimizer.muon_param_ids(),
            )
            self.optimizer.load_state_tensors(state)
            if self.rank == 0 and not same_layout:
                print(
                    f"modelpar-train: {ckpt} was saved with layout {index['layout']}; weights, data position and "
                    f"Adam moments are resharded to {asdict(self.layout)}",
                    flush=True,
                )
        elif optim and index.get("optimizer", True):  # per-rank state (checkpoints from before the logical one)
            self.optimizer.load_state_tensors(optim)
        elif self.rank == 0:
            print(
                f"modelpar-train: {ckpt} holds no optimizer state for layout {asdict(self.layout)} (saved with "
                f"{index['layout']}, before any optimizer step); weights and data position are loaded, the optimizer "
                "starts fresh",
                flush=True,
            )

    def _verify_once(self, ckpt: Path, index: dict) -> None:
        """Rank 0 hashes the checkpoint; every rank raises the same ``CheckpointError`` if it fails."""
        verdict = [None]
        if self.rank == 0:
            try:
                read_signed_index(ckpt, self.signing_key)
                check_same_data(index.get("data_fingerprint"), self.data_path, self.cfg.data.allow_changed, ckpt)
            except (CheckpointError, DataError) as exc:
                verdict = [str(exc)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise CheckpointError(verdict[0])

    # -- the loop ------------------------------------------------------------------------------------------

    def fit(self) -> None:
        t = self.cfg.trainer
        sinks = open_sinks(self.cfg, self.out_dir, self.step) if self.rank == 0 else []
        profiler = StepProfiler.of(self.cfg, self.out_dir, self.rank, self.device)
        stop = StopRequest.install()  # Ctrl-C: every rank stops after the same step and saves it
        try:
            while self.step < t.steps:
                profiler.starting(self.step + 1)
                m = self.train_step()
                profiler.finished(self.step)
                if self.async_ckpt is not None and self.async_ckpt.in_flight is not None:
                    self.save_or_report(finish=True)  # the writer had this step to finish its files
                if self._ckpt_report is not None:
                    m, self._ckpt_report = replace(m, checkpoint=self._ckpt_report), None
                for sink in sinks:
                    sink.write(m)
                saving = t.ckpt_every and (self.step % t.ckpt_every == 0 or self.step == t.steps)
                if saving:
                    self.save_or_report()
                if stop.after(self.step):
                    if not saving:
                        self.save_or_report()
                    break
            self.save_or_report(finish=True)
        finally:
            stop.uninstall()
            profiler.close()
            for sink in sinks:
                sink.close()
        collectives.set_collective_observer(None)
        self.flight.close()
        self.tuning.close()


def train_worker(cfg: TrainConfig, data_path: str, resume_from: str | None, resume_verified: bool = False) -> None:
    """Entry point of every rank (after the process group is initialised)."""
    torch.manual_seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed)
    Trainer(cfg, data_path, resume_from, resume_verified=resume_verified).fit()


__all__ = ["Trainer", "train_worker"]
