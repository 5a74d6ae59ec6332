"""modelpar-train: pretrain with a Hydra recipe on any tp x cp x pp x dp layout.

    modelpar-train                                   # recipes/train.yaml: tiny model, tp=2 x pp=2, 1F1B, 4 CPU ranks
    modelpar-train parallel=dp2-tp2-pp2 trainer.steps=50
    modelpar-train parallel.tp=2 parallel.pp=2 parallel.schedule=zb-h1 parallel.microbatches=8
    modelpar-train -m parallel=single,tp2,pp2        # a Hydra multirun sweep
    modelpar-train parallel=single parallel.cp=2 data.document_mask=true   # each sequence over 2 ranks

Everything that can be checked is checked here, before any rank starts (one line per problem,
``modelpar.training.preflight``). Outside torchrun/SLURM the ranks are spawned locally; under them, this
process is one rank.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from modelpar.backends import rank_setup
from modelpar.checkpoint.signing import load_key
from modelpar.checkpoint.store import latest_checkpoint
from modelpar.cli.eval import model_of_checkpoint
from modelpar.cli.generate import sample_from_checkpoint
from modelpar.cli.overrides import refuse_unknown_overrides
from modelpar.data import DataError
from modelpar.parallel.launch import LaunchError, launch
from modelpar.parallel.world import launch_env_from_environ
from modelpar.training.config import FILE_ACCESS, RECIPES, TrainConfig, register_schema, validate
from modelpar.training.elastic import available_world, elastic_config, lost_dir, lost_ranks
from modelpar.training.faults import FIRED_ENV, LOST_ENV
from modelpar.training.final_save import unsaved_final_state
from modelpar.training.flight import flight_hang_report
from modelpar.training.init_from import init_source
from modelpar.training.interrupt import StopOnInterrupt
from modelpar.training.outliers import outlier_check_note
from modelpar.training.preflight import USER_ERRORS, preflight, runs_on_cpu
from modelpar.training.restart import RestartPolicy, run_with_restarts
from modelpar.training.run_dir import RunDirError, RunLock, check_writable, run_dir_of
from modelpar.training.security import VERDICTS, admission_spec, record_verdict
from modelpar.training.trainer import train_worker


def fail(message: str, status: int = 2) -> None:
    print(f"modelpar-train: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def run(cfg: TrainConfig, overridden: Mapping[str, str] | None = None) -> None:
    """``overridden``: what the user set on the command line, key -> value (``model.hidden``, or ``model`` for
    a whole model recipe): with ``trainer.init_from`` every other model field comes from the weights."""
    if cfg.trainer.files in FILE_ACCESS:
        mask = FILE_ACCESS[cfg.trainer.files]
        os.umask(mask)  # the ranks inherit it
        run_dir = Path(cfg.trainer.out_dir)
        hydra_dir = run_dir / ".hydra"  # what Hydra wrote before this ran: the run directory and its config
        hydra_files = [*hydra_dir.iterdir()] if hydra_dir.is_dir() else []
        for path in [run_dir, *run_dir.glob("*.log"), hydra_dir, *hydra_files]:  # *.log: Hydra's job log
            if path.exists():
                path.chmod(path.stat().st_mode & ~mask & 0o7777)
    out_dir = Path(cfg.trainer.out_dir)
    env = launch_env_from_environ()
    job_rank0 = env is None or env.rank == 0  # under torchrun/SLURM every rank runs this function
    source = None
    if cfg.trainer.init_from:
        try:
            source = init_source(cfg.trainer.init_from, load_key(cfg.trainer.signing_key or None))
            cfg = replace(cfg, model=model_of_checkpoint(cfg, source.model, overridden or {}, source.path))
        except USER_ERRORS as exc:
            fail(str(exc))
    recipe = cfg
    cfg = laid_out(recipe, env, out_dir, job_rank0)
    try:
        check_writable(out_dir)
        lock = RunLock.acquire(out_dir) if job_rank0 else None  # held until this process ends  # noqa: F841
        admission = admission_spec(cfg, multi_node=env is not None)
        train_path, val_path, resume_from = preflight(cfg)
    except (*USER_ERRORS, RunDirError) as exc:
        if job_rank0 and not isinstance(exc, RunDirError):
            record_verdict(out_dir, exc, None)
        fail(str(exc))
    note = outlier_check_note(cfg.trainer.grad_outlier_action, cfg.parallel.dp, cfg.optim.zero)
    if job_rank0 and note:
        print(f"modelpar-train: note: {note}", flush=True)
    if job_rank0:
        print(
            f"modelpar-train: {describe_run(cfg)} -> {out_dir}"
            + (f", resuming from {resume_from}" if resume_from else "")
            + (f", weights of {source.describe()}" if source is not None and not resume_from else ""),
            flush=True,
        )
    policy = RestartPolicy(cfg.trainer.max_restarts, cfg.trainer.restart_backoff_s)
    if policy.max_restarts and env is not None:
        print(
            "modelpar-train: trainer.max_restarts applies to locally spawned jobs; under torchrun use "
            "--max-restarts (each new worker resumes from the newest verified checkpoint)",
            flush=True,
        )
        policy = RestartPolicy(0)
    if policy.max_restarts:
        os.environ[FIRED_ENV] = str(out_dir / "flight" / "faults-fired")  # an injected fault happens once
    if env is None:
        os.environ[LOST_ENV] = str(lost_dir(out_dir))  # where the ``lose`` fault declares its rank gone

    def attempt(restart: int) -> None:
        resume, run_cfg = resume_from, cfg
        if restart and interrupt.requested:
            interrupted(out_dir, stopped=False)  # Ctrl-C is not a failure to restart from
        if restart:
            run_cfg = laid_out(recipe, env, out_dir, job_rank0)  # fewer ranks if one was lost for good
            try:
                _, _, resume = preflight(run_cfg)  # the newest checkpoint that verifies now
            except USER_ERRORS as exc:
                record_verdict(out_dir, exc, None)
                fail(str(exc))
            start = f"the weights of {source.describe()}" if source else "the start"
            print(f"modelpar-train: resuming from {resume or start + ' (no checkpoint yet)'}", flush=True)
        launch(
            run_cfg.parallel.layout().world_size,
            train_worker,
            run_cfg,
            train_path,
            resume,
            True,  # preflight verified the checkpoint: the ranks load it without hashing it again
            timeout_s=cfg.trainer.timeout_s,
            threads_per_rank=cfg.trainer.threads_per_rank,
            hang_report=partial(flight_hang_report, str(out_dir / "flight")),
            rank_setup=rank_setup(runs_on_cpu(cfg), cfg.trainer.threads_per_rank, cfg.trainer.cpu_affinity),
            log_path=str(out_dir / "failure.log"),
            # every attempt admits its ranks again (torchrun counts its own restarts)
            admission=replace(admission, attempt=restart + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
            if admission
            else None,
        )

    with StopOnInterrupt() as interrupt:
        try:
            run_with_restarts(attempt, policy, out_dir / "restarts.jsonl", say=partial(print, flush=True))
        except LaunchError as exc:
            if interrupt.requested:
                interrupted(out_dir, stopped=False)
            record_verdict(out_dir, exc, exc.rank)
            print(f"modelpar-train: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except VERDICTS as exc:  # under torchrun/SLURM: this rank's own verdict, recorded by one rank
            if getattr(exc, "reporter", job_rank0):
                record_verdict(out_dir, exc, env.rank)
            print(f"modelpar-train: rank {env.rank}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    if interrupt.requested:
        interrupted(out_dir, stopped=True)
    problem = unsaved_final_state(cfg) if job_rank0 else None
    if problem:
        fail(problem, status=1)
    if job_rank0:
        summarize(cfg, val_path)


def interrupted(out_dir: Path, stopped: bool) -> None:
    """Exit 130 with one line: where the interrupted run's newest saved state is."""
    newest = latest_checkpoint(out_dir / "checkpoints")
    how = "every rank stopped and saved" if stopped else "stopped before the ranks agreed on a step to save"
    held = f"the newest saved state is {newest}" if newest else "nothing was saved"
    print(
        f"modelpar-train: interrupted ({how}); {held}; rerun the same command to go on from there",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(130)


def laid_out(cfg: TrainConfig, env, out_dir: Path, say: bool) -> TrainConfig:
    """The recipe on the world now available: under ``trainer.elastic`` re-laid out for torchrun's world or
    for ``trainer.world`` less the ranks lost (one line saying what changed); otherwise the recipe, once a
    different local world has been refused (``modelpar.training.elastic``)."""
    try:
        if env is not None:
            if not cfg.trainer.elastic:
                return cfg  # the launcher names a world that differs from the layout's
            world = env.world_size
        else:
            world = available_world(cfg, lost_ranks(out_dir))
        cfg, note = elastic_config(cfg, world)
    except USER_ERRORS as exc:
        fail(str(exc))
    if say and note:
        print(f"modelpar-train: {note}", flush=True)
    return cfg


def _count(n: int, word: str, plural: str = "") -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def describe_run(cfg: TrainConfig) -> str:
    """The start-up banner: model (and its experts), layout, ZeRO stage, schedule, masking, steps; what of the
    model's block runs on the torch path where the Triton kernels may run (``model.kernels`` not torch)."""
    layout, p, moe = cfg.parallel.layout(), cfg.parallel, cfg.model.moe
    model = cfg.model.name + (f" (MoE {moe.experts} experts, top-{moe.top_k})" if moe.enabled else "")
    parts = [f"{model} on {layout} ({_count(layout.world_size, 'rank')})"]
    clamped = ["clamped SwiGLU experts (the fused kernel is SwiGLU)"] if moe.activation == "clamped_swiglu" else []
    unfused = cfg.model.block.unfused() + clamped if cfg.model.kernels != "torch" else []
    if unfused:
        parts.append(f"torch path for {' and '.join(unfused)}")
    if cfg.optim.zero:
        parts.append(f"ZeRO-{cfg.optim.zero}")
    parts.append(f"schedule {p.schedule}, {_count(p.microbatches, 'micro-batch', 'micro-batches')}")
    if cfg.data.document_mask:
        parts.append("document masking")
    parts.append(_count(cfg.trainer.steps, "step"))
    return ", ".join(parts)


def summarize(cfg: TrainConfig, val_path: str) -> None:
    """Loss at the start and end of the run, the checkpoint, and a sample from the final weights."""
    out_dir = Path(cfg.trainer.out_dir)
    ckpt = latest_checkpoint(out_dir / "checkpoints")
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    if lines:
        first, last = json.loads(lines[0]), json.loads(lines[-1])
        start, end = f"{first['loss']:.4f} (step {first['step']})", f"{last['loss']:.4f} (step {last['step']})"
        print(f"modelpar-train: loss {start} -> {end}")
    if ckpt is None:
        return
    print(f"modelpar-train: checkpoint {ckpt}")
    if cfg.trainer.sample_tokens > 0:
        try:
            sample = sample_from_checkpoint(ckpt, val_path, cfg.trainer.sample_tokens, seq_len=cfg.data.seq_len)
        except DataError as exc:  # a plain token file has no tokenizer to decode with: the run still trained
            print(f"modelpar-train: no sample ({exc}); modelpar-generate can sample token ids", flush=True)
            return
        print("\n".join(sample.lines()), flush=True)


def dry_run(cfg: TrainConfig, preset: str) -> None:
    """``trainer.dry_run=true``: step the layout's rank roles on the meta device (``modelpar.bench.dry_run``);
    the last line is the summary as JSON."""
    from modelpar.bench.dry_run import dry_run as step_roles
    from modelpar.bench.dry_run import summary_line

    try:
        validate(cfg)
    except USER_ERRORS as exc:
        fail(str(exc))
    if cfg.trainer.dry_run_ranks not in ("roles", "all"):
        fail(f"trainer.dry_run_ranks={cfg.trainer.dry_run_ranks!r} must be roles or all")
    layout = cfg.parallel.layout()
    print(f"modelpar-train: dry run of {preset} ({layout}, {layout.world_size} ranks) on the meta device", flush=True)
    try:
        result = step_roles(cfg, preset=preset, every=cfg.trainer.dry_run_ranks == "all")
    except ValueError as exc:
        fail(str(exc))
    print(summary_line(result), flush=True)


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="train")
def _app(dcfg: DictConfig) -> None:
    if dcfg.trainer.dry_run and OmegaConf.is_missing(dcfg.data, "path"):
        dcfg.data.path = ""  # a dry run reads no data
    cfg: TrainConfig = OmegaConf.to_object(dcfg)
    if cfg.trainer.dry_run:
        dry_run(cfg, HydraConfig.get().job.config_name)
        return
    overrides = HydraConfig.get().overrides.task  # what the user set, e.g. "model.hidden=32" or "model=tiny"
    run(replace(cfg), dict((o.split("=", 1) + [""])[:2] for o in (o.lstrip("+~") for o in overrides)))


def main() -> None:
    refuse_unknown_overrides("modelpar-train", TrainConfig, RECIPES)
    os.umask(FILE_ACCESS["group"])  # before Hydra makes the run directory: nothing the run writes is world-readable
    run_dir = run_dir_of(sys.argv[1:])
    try:
        if run_dir is not None:
            check_writable(run_dir)  # before Hydra makes it: a PermissionError there is a traceback
    except RunDirError as exc:
        fail(str(exc))
    register_schema()
    try:
        _app()
    except KeyboardInterrupt:
        print("modelpar-train: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
