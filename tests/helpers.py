"""What many test modules share: the tiny model and its training config, a multi-process training run of the
CLI, a tiny bench config, and the pieces-to-tensors assembly that layout comparisons use. No test module imports
another; they import this."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from modelpar.training.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, TrainerConfig
from tests import warm_cli

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


TINY = ModelConfig(
    name="test",
    vocab_size=61,
    hidden=32,
    layers=4,
    heads=4,
    kv_heads=2,
    ffn_hidden=48,
    max_seq_len=32,
    tie_embeddings=True,
)


def make_config(tmp_path, **parallel) -> TrainConfig:
    return TrainConfig(
        model=TINY,
        parallel=ParallelConfig(**{"microbatches": 2, **parallel}),
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, grad_clip=0.5, bucket_mb=0.001),
        data=DataConfig(seq_len=16, global_batch=8, seed=7),
        trainer=TrainerConfig(steps=3, out_dir=str(tmp_path), progress=False, timeout_s=60.0),
    )


def train_and_collect(cfg: TrainConfig, data_path: str, resume_from=None, save_at=()):
    """On every rank: train to ``cfg.trainer.steps``; return (loss, grad norm) per step and this rank's pieces."""
    from modelpar.checkpoint.reshard import model_pieces
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, resume_from)
    losses = []
    while trainer.step < cfg.trainer.steps:
        metrics = trainer.train_step()
        losses.append((metrics.loss, metrics.grad_norm))
        if trainer.step in save_at:
            trainer.save()
    pieces = {(p.name, p.region): t.detach().clone() for p, t in model_pieces(trainer.model.chunks).items()}
    return losses, pieces


def assemble(results) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's pieces."""
    shapes: dict[str, list[int]] = {}
    for _, pieces in results:
        for (name, region), _ in pieces.items():
            shapes[name] = [
                max(a, b) for a, b in zip(shapes.get(name, [0] * len(region)), (r[1] for r in region), strict=True)
            ]
    full = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
    for _, pieces in results:
        for (name, region), tensor in pieces.items():
            full[name][tuple(slice(a, b) for a, b in region)] = tensor
    return full


def assert_matches_reference(results, reference, label) -> None:
    """Every rank's losses and the assembled parameters equal the single-device run's (1e-5)."""
    ref_losses, ref_params = reference
    for losses, _ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=str(label))
    params = assemble(results)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        # atol: Adam divides by sqrt(v), so an element whose gradient is at rounding level (tp4's summation order
        # differs from one device's) can move by a little more than 1e-6 of the lr=1e-3 step: 1.05e-6 was seen
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")


def logits_after_loading(cfg: TrainConfig, data_path: str, ckpt: str):
    """Every rank loads ``ckpt`` into its layout; the last stage returns the full-vocab logits of one batch."""
    import torch.distributed as dist

    from modelpar.parallel.collectives import all_gather
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, ckpt)
    inputs, _ = trainer.tokens.batch(range(2))
    x = inputs
    with torch.no_grad():
        for chunk in trainer.model.chunks:  # pp=1 layouts: one rank holds every layer
            x = chunk(x)
        if trainer.groups.layout.tp > 1:
            x = all_gather(x.contiguous(), trainer.groups.tp_group, dim=-1)
    return x[..., : cfg.model.vocab_size].detach(), dist.get_rank()


SMALL = [  # the default recipe's model, shrunk: every run here is a real multi-process job
    "model.hidden=32", "model.layers=2", "model.ffn_hidden=64", "data.seq_len=32", "data.global_batch=8",
    "data.corpus_max_bytes=200000", "trainer.progress=false", "trainer.sample_tokens=0",
]  # fmt: skip


def train(tmp_path: Path, *overrides: str, faults: str = "", timeout: int = 240):
    env = dict(os.environ, MODELPAR_FAULTS=faults)
    start = time.time()
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", *SMALL, f"hydra.run.dir={tmp_path}", *overrides],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    return proc, time.time() - start


def tiny_bench_config(tmp, *extra):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    tokens = tmp / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint16))
    overrides = [
        "model=tiny",
        "model.tie_embeddings=false",
        "data.seq_len=16",
        "data.global_batch=8",
        f"data.path={tokens}",
        "parallel.microbatches=4",
        "bench.sweep=[single,tp2,pp2-1f1b]",
        "bench.warmup=1",
        "bench.rounds=1",
        "bench.steps_per_round=1",
        "bench.peak_tflops=0.1",
        f"bench.results_dir={tmp}",
        "trainer.out_dir=" + str(tmp / "run"),
        *extra,
    ]
    from modelpar.bench.config import register_bench_schema

    register_bench_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="bench", overrides=overrides))


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The whole logical tensors of the checkpoint a run wrote at ``step``."""
    from modelpar.checkpoint.store import Piece, load_pieces, read_index, step_dir

    ckpt = step_dir(run_dir / "checkpoints", step)
    index = read_index(ckpt)
    wanted = [Piece.whole(name, tuple(t["global_shape"])) for name, t in index["tensors"].items()]
    return {p.name: t for p, t in load_pieces(ckpt, index, wanted).items()}


def save_whole_model_checkpoint(root, config: ModelConfig, model=None, **meta):
    """A one-rank checkpoint of ``model`` (default ``build_model(config, seed=0)``) under ``root`` (what import-hf
    writes), with ``meta`` added to its index; returns its step directory."""
    from dataclasses import asdict

    from modelpar.checkpoint.reshard import model_pieces
    from modelpar.checkpoint.save import save_checkpoint
    from modelpar.model.transformer import build_model
    from modelpar.parallel.layout import ParallelLayout

    meta = {"layout": asdict(ParallelLayout()), "model": asdict(config), "parallel": asdict(ParallelConfig()),
            "world_size": 1, "sampler": None, "optimizer": False, **meta}  # fmt: skip
    pieces = model_pieces([model if model is not None else build_model(config, seed=0)])
    return save_checkpoint(root, 0, pieces, {"rng/torch": torch.get_rng_state()}, meta)


LISTEN = "0A"
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1


def descendants(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid and p not in found]
        found.update(children)
        frontier.extend(children)
    return found


def socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def listening(inodes: set[str]) -> set[str]:
    """Local addresses (hex, as /proc/net shows them) of the listening TCP sockets among ``inodes``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                out.add(fields[1])
    return out


def listening_addresses(*roots: int) -> set[str]:
    """Local addresses (hex ``addr:port`` as /proc/net/tcp shows them) the process trees of ``roots`` listen on."""
    return listening(socket_inodes(set().union(*(descendants(r) for r in roots))))
