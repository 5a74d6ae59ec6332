"""modelpar-ckpt: inspect, verify, reshard and convert checkpoints.

    modelpar-ckpt verify  runs/x/checkpoints                    # latest (or a step-* directory): every SHA-256
    modelpar-ckpt reshard runs/x/checkpoints/step-00000200 out/tp4 --tp 4 --pp 1
    modelpar-ckpt import-hf path/to/llama-hf ckpts/imported       # Llama, Mistral, Mixtral, Qwen3(-MoE), DeepSeek-V3
    modelpar-ckpt export-hf runs/x/checkpoints/step-00000200 hf/  # -> the family the model is (modelpar.model.hf)

import-hf and export-hf stream one tensor at a time (``modelpar.checkpoint.hf_stream``): a sharded directory of
any size converts in a few times its largest tensor's memory.

Any layout can also load any checkpoint directly (``trainer.resume=PATH``); ``reshard`` writes the files of the
new layout ahead of time. Only safetensors and JSON are read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from modelpar.backends import rank_setup
from modelpar.checkpoint.hf_stream import DTYPE_NAMES, TOKENIZER_FILES, export_hf_dir, import_hf_dir, model_config_of
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
from modelpar.model.hf import CONFIG_NAME, config_to_hf
from modelpar.model.hf_files import DEFAULT_MAX_SHARD, INDEX_FILE, weight_files
from modelpar.model.hf_gpt_oss import mxfp4_experts
from modelpar.model.safetensors_io import TensorReader
from modelpar.parallel.groups import ParallelGroups
from modelpar.parallel.launch import LaunchError, current_umask, launch
from modelpar.parallel.layout import LayoutError
from modelpar.training.build import build_rank_model
from modelpar.training.config import ParallelConfig, TrainConfig, TrainerConfig


def refuse_existing(dst: Path) -> None:
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty; choose a new destination (nothing is overwritten)")


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
    # the ranks work on CPU: started as a training run's CPU ranks are (forked from a server that imported torch
    # and the engine once, not each a fresh interpreter importing them again)
    setup = rank_setup(True, cfg.trainer.threads_per_rank, cfg.trainer.cpu_affinity)
    launch(layout.world_size, _reshard_worker, str(src), str(dst), cfg, int(index["step"]), meta, rank_setup=setup)
    written = resolve_checkpoint(dst)
    read_index(written, verify=True)
    print(f"{written}: resharded {src} ({index['layout']}) -> {asdict(layout)}")
    return 0


def cmd_import_hf(args) -> int:
    dst = Path(args.dst)
    refuse_existing(dst)
    meta = {"parallel": asdict(ParallelConfig())}
    path = import_hf_dir(args.hf_dir, dst, dtype=args.dtype, meta=meta)
    index = read_index(path, verify=False)
    model = model_config_of(index)
    dtypes = ", ".join(sorted({info["dtype"] for info in _headers(path, index)}))
    hf = json.loads((Path(args.hf_dir) / CONFIG_NAME).read_text())
    dequantised = "; the MXFP4 experts dequantised (export writes them unquantised)" if mxfp4_experts(hf) else ""
    print(
        f"{path}: imported {args.hf_dir} ({model.layers} layers, hidden {model.hidden}, vocab {model.vocab_size}; "
        f"{dtypes}, streamed one tensor at a time{dequantised})"
    )
    return 0


def _headers(ckpt: Path, index: dict) -> list[dict]:
    """The safetensors header entries of a checkpoint's model pieces."""
    out = []
    for file in sorted({p["file"] for entry in index["tensors"].values() for p in entry["pieces"]}):
        with TensorReader(ckpt / file) as reader:
            out.extend(reader.header.values())
    return out


def cmd_export_hf(args) -> int:
    src = resolve_checkpoint(args.src)
    out = Path(args.hf_dir)
    refuse_existing(out)
    key = load_key(args.key)
    index = read_signed_index(src, key)
    architecture = config_to_hf(model_config_of(index))["architectures"][0]  # refused before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # renamed into place when complete
    try:
        export_hf_dir(src, index, tmp, max_shard_size=args.max_shard_size, dtype=args.dtype)
        weights = list(weight_files(tmp))
        signed = ""
        if key is not None:
            for file in weights:
                sign_file(file, key, file.with_name(file.name + ".sig"))
            signed = ", each signed (.sig)"
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp's directory is owner-only; the export is an ordinary one
        tmp.rename(out)  # an empty destination directory is replaced; a non-empty one was refused above
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = f"{weights[0].name}" if len(weights) == 1 else f"{len(weights)} shards + {INDEX_FILE}"
    extra = [name for name in TOKENIZER_FILES if (out / name).exists()]
    print(
        f"{out}: exported {src} as a {architecture} directory (config.json + {files}{signed}"
        + (f"; {', '.join(extra)}" if extra else "")
        + ")"
    )
    return 0


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
    p.add_argument("hf_dir", help="config.json + model.safetensors, or shards + model.safetensors.index.json")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="default: each tensor's in the files")
    p.set_defaults(fn=cmd_import_hf)
    p = sub.add_parser(
        "export-hf", help="checkpoint -> a Llama, Mistral, Mixtral, Qwen3(-MoE) or DeepSeek-V3 directory"
    )
    p.add_argument("src")
    p.add_argument("hf_dir")
    p.add_argument("--key", default=None, help=key_help + "; signs each weight file too")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="shard size, e.g. 5GB (default), 500MB, 2GiB")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="default: the checkpoint's")
    p.set_defaults(fn=cmd_export_hf)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (CheckpointError, LayoutError, LaunchError, ValueError, OSError) as exc:
        print(f"modelpar-ckpt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
