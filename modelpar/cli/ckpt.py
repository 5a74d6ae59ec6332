"""modelpar-ckpt: inspect, verify, reshard and convert checkpoints.

    modelpar-ckpt verify  runs/x/checkpoints                    # latest (or a step-* directory): every SHA-256
    modelpar-ckpt reshard runs/x/checkpoints/step-00000200 out/tp4 --tp 4 --pp 1
    modelpar-ckpt import-hf path/to/llama-hf ckpts/imported       # Llama, Mistral, Mixtral, Qwen3(-MoE), DeepSeek-V3
    modelpar-ckpt export-hf runs/x/checkpoints/step-00000200 hf/  # -> the family the model is (modelpar.model.hf)

Any layout can also load any checkpoint directly (``trainer.resume=PATH``); ``reshard`` writes the files of the
new layout ahead of time. Only safetensors and JSON are read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from modelpar.checkpoint.reshard import load_model_from_checkpoint, load_optimizer_pieces, model_pieces
from modelpar.checkpoint.save import save_checkpoint
from modelpar.checkpoint.signing import (
    KEY_ENV,
    keygen,
    load_key,
    read_signed_index,
    sign_checkpoint,
    sign_file,
)
from modelpar.checkpoint.store import CheckpointError, read_index, resolve_checkpoint
from modelpar.cli.generate import load_single_device_model
from modelpar.model.config import ModelConfig
from modelpar.model.hf import config_from_hf, config_to_hf, import_hf, save_hf
from modelpar.model.transformer import build_model
from modelpar.parallel.groups import ParallelGroups
from modelpar.parallel.launch import LaunchError, launch
from modelpar.parallel.layout import LayoutError, ParallelLayout
from modelpar.training.build import build_rank_model
from modelpar.training.config import ParallelConfig, TrainConfig, TrainerConfig


def refuse_existing(dst: Path) -> None:
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty; choose a new destination (nothing is overwritten)")


def model_config_of(index: dict) -> ModelConfig:
    fields = {k: v for k, v in index["model"].items() if k in ModelConfig.__dataclass_fields__}
    return ModelConfig(**fields)


def cmd_verify(args) -> int:
    ckpt = resolve_checkpoint(args.path)
    key = load_key(args.key)
    index = read_signed_index(ckpt, key)
    total = sum(info["bytes"] for info in index["files"].values())
    signed = ", signature verified" if key is not None else ""
    print(
        f"{ckpt}: OK — step {index['step']}, layout {index['layout']}, {len(index['tensors'])} tensors, "
        f"{len(index['files'])} files, {total / 2**20:.1f} MiB, every SHA-256 verified{signed}"
    )
    return 0


def cmd_keygen(args) -> int:
    try:
        path = keygen(args.path)
    except FileExistsError:
        raise CheckpointError(f"{args.path} exists; refusing to overwrite a key (choose a new file)") from None
    print(f"{path}: new signing key (owner-only); pass trainer.signing_key={path} or export {KEY_ENV}={path}")
    return 0


def cmd_sign(args) -> int:
    ckpt = resolve_checkpoint(args.path)
    key = load_key(args.key)
    read_index(ckpt, verify=True)  # sign only what verifies
    print(f"{sign_checkpoint(ckpt, key)}: signed {ckpt}")
    return 0


def _reshard_worker(src: str, dst_root: str, cfg: TrainConfig, step: int, meta: dict) -> None:
    groups = ParallelGroups.build(cfg.parallel.layout())
    model = build_rank_model(cfg, groups, torch.device("cpu"))
    index = read_index(src, verify=False)
    load_model_from_checkpoint(model.chunks, Path(src), index)
    moments = load_optimizer_pieces(model.chunks, Path(src), index) if "optimizer_step" in meta else {}
    rng = {"rng/torch": torch.get_rng_state()}
    save_checkpoint(dst_root, step, model_pieces(model.chunks), rng, meta, optimizer=moments)


def cmd_reshard(args) -> int:
    src = resolve_checkpoint(args.src)
    index = read_signed_index(src, load_key(None))
    dst = Path(args.dst)
    refuse_existing(dst)
    model = model_config_of(index)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp, cp=args.cp, ep=args.ep, sp=False)
    layout = parallel.layout()
    model.check_layout(layout)  # shapes, and the experts' split over ep
    cfg = TrainConfig(model=model, parallel=parallel, trainer=TrainerConfig(progress=False))
    meta = {
        "layout": asdict(layout),
        "model": asdict(model),
        "parallel": asdict(parallel),
        "world_size": layout.world_size,
        "sampler": index.get("sampler"),
        "optimizer": False,  # no per-rank optimizer state; plain AdamW's logical moments travel (below)
        "resharded_from": str(src),
    }
    if "optimizer_tensors" in index and "optimizer_step" in index:
        meta["optimizer_step"] = index["optimizer_step"]
    launch(layout.world_size, _reshard_worker, str(src), str(dst), cfg, int(index["step"]), meta)
    written = resolve_checkpoint(dst)
    read_index(written, verify=True)
    print(f"{written}: resharded {src} ({index['layout']}) -> {asdict(layout)}")
    return 0


def cmd_import_hf(args) -> int:
    dst = Path(args.dst)
    refuse_existing(dst)
    tcfg = config_from_hf(args.hf_dir)
    model = build_model(tcfg, seed=0)
    import_hf(args.hf_dir, model)
    mcfg = replace(tcfg, name=Path(args.hf_dir).name)
    layout = ParallelLayout()
    meta = {
        "layout": asdict(layout),
        "model": asdict(mcfg),
        "parallel": asdict(ParallelConfig()),
        "world_size": 1,
        "sampler": None,
        "optimizer": False,
        "imported_from": str(args.hf_dir),
    }
    path = save_checkpoint(dst, 0, model_pieces([model]), {"rng/torch": torch.get_rng_state()}, meta)
    print(f"{path}: imported {args.hf_dir} ({tcfg.layers} layers, hidden {tcfg.hidden}, vocab {tcfg.vocab_size})")
    return 0


def cmd_export_hf(args) -> int:
    src = resolve_checkpoint(args.src)
    out = Path(args.hf_dir)
    refuse_existing(out)
    key = load_key(args.key)
    read_signed_index(src, key)
    model = load_single_device_model(src)
    architecture = config_to_hf(model.config)["architectures"][0]  # refused here, before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # renamed into place when complete
    try:
        save_hf(tmp, model.config, model.full_state())
        signed = ""
        if key is not None:
            sign_file(tmp / "model.safetensors", key, tmp / "model.safetensors.sig")
            signed = " and model.safetensors.sig"
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's directory is owner-only; the export is an ordinary one
        tmp.rename(out)  # an empty destination directory is replaced; a non-empty one was refused above
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{out}: exported {src} as a {architecture} directory (config.json + model.safetensors{signed})")
    return 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelpar-ckpt", description="Inspect, verify, reshard and convert.")
    sub = parser.add_subparsers(dest="command", required=True)
    key_help = f"signing key file (default: ${KEY_ENV}; none: hashes only)"
    p = sub.add_parser("verify", help="check every file's SHA-256, and that none is missing or extra")
    p.add_argument("path")
    p.add_argument("--key", default=None, help=key_help)
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("keygen", help="write a new signing key file (owner-only)")
    p.add_argument("path")
    p.set_defaults(fn=cmd_keygen)
    p = sub.add_parser("sign", help="sign an existing checkpoint's index")
    p.add_argument("path")
    p.add_argument("--key", required=True, help="signing key file")
    p.set_defaults(fn=cmd_sign)
    p = sub.add_parser("reshard", help="write a checkpoint for another layout")
    p.add_argument("src")
    p.add_argument("dst")
    for name in ("tp", "pp", "dp", "vpp", "cp", "ep"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.set_defaults(fn=cmd_reshard)
    p = sub.add_parser(
        "import-hf", help="a Llama, Mistral, Mixtral, Qwen3(-MoE) or DeepSeek-V3 directory -> checkpoint (any layout)"
    )
    p.add_argument("hf_dir")
    p.add_argument("dst")
    p.set_defaults(fn=cmd_import_hf)
    p = sub.add_parser(
        "export-hf", help="checkpoint -> a Llama, Mistral, Mixtral, Qwen3(-MoE) or DeepSeek-V3 directory"
    )
    p.add_argument("src")
    p.add_argument("hf_dir")
    p.add_argument("--key", default=None, help=key_help + "; signs model.safetensors too")
    p.set_defaults(fn=cmd_export_hf)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (CheckpointError, LayoutError, LaunchError, ValueError, OSError) as exc:
        print(f"modelpar-ckpt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
