"""Hugging Face directory <-> checkpoint, one tensor at a time, never building the model.

Import: the model's logical tensors are listed from a chunk built on the ``meta`` device (names and shapes,
no memory); each is read from the HF file that holds it (plain reads of exactly its bytes: a fused expert's
rows, a whole tensor otherwise), renamed, its RoPE rows reordered for DeepSeek-V3, cast to the dtype asked
(default: the file's) and written into the checkpoint file for that HF file, hashed as written. Export reads
each logical tensor's regions from the checkpoint's pieces (any layout), renames and reorders it the other
way and writes it into the shard it belongs to. Either way one tensor is resident at a time (twice when
cast): peak memory is a few times the largest tensor plus the interpreter, whatever the model's size.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from modelpar.checkpoint.schema import check_file_name
from modelpar.checkpoint.store import (
    FORMAT,
    INDEX,
    LATEST,
    CheckpointError,
    fsync_dir,
    fsync_write,
    region_key,
    step_dir,
)
from modelpar.model.config import ModelConfig
from modelpar.model.hf import CONFIG_NAME, config_from_hf, config_to_hf, hf_name, hf_source
from modelpar.model.hf_deepseek import DEEPSEEK_TYPES, rope_rows_from_hf, rope_rows_to_hf
from modelpar.model.hf_files import DEFAULT_MAX_SHARD, HFWeights, write_hf_weights
from modelpar.model.hf_gpt_oss import GPT_OSS_TYPES, expert_from_fused, fused_experts_of, fused_value
from modelpar.model.mxfp4 import SUFFIXES as MXFP4_SUFFIXES
from modelpar.model.mxfp4 import mxfp4_expert
from modelpar.model.safetensors_io import TensorReader, TensorWriter
from modelpar.model.spec import ChunkSpec
from modelpar.model.transformer import ModelChunk
from modelpar.parallel.layout import ParallelLayout

DTYPE_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def logical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of the single-device model and its shape, from a chunk on the ``meta`` device."""
    chunk = ModelChunk(config, ChunkSpec(tuple(range(config.layers)), device="meta"))
    return {name: tuple(shard.global_shape) for name, shard in chunk.logical_shards().items()}


def model_config_of(index: dict) -> ModelConfig:
    """The ``ModelConfig`` a checkpoint's index records."""
    return ModelConfig(**{k: v for k, v in index["model"].items() if k in ModelConfig.__dataclass_fields__})


def import_hf_dir(hf_dir: str | Path, dst: str | Path, dtype: str | None = None, meta: dict | None = None) -> Path:
    """Convert HF directory ``hf_dir`` into a single-device checkpoint (step 0) under ``dst``; ``dtype``:
    ``bf16`` | ``fp32`` | None (each tensor as the file holds it); ``meta``: more fields for its index.
    Returns the checkpoint directory."""
    hf_dir, dst = Path(hf_dir), Path(dst)
    cast = DTYPE_NAMES[dtype] if dtype else None
    config = replace(config_from_hf(hf_dir), name=hf_dir.name)
    hf = json.loads((hf_dir / CONFIG_NAME).read_text())
    shapes = logical_shapes(config)
    final = step_dir(dst, 0)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files, tensors = _write_pieces(hf_dir, tmp, config, hf, shapes, cast)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, KeyError):  # a tensor the config needs that no file holds
            raise CheckpointError(str(exc.args[0])) from None
        raise
    tokenizer = hf_dir / "tokenizer.json"
    index = {
        "format": FORMAT,
        "step": 0,
        "layout": asdict(ParallelLayout()),
        "model": asdict(config),
        "world_size": 1,
        "sampler": None,
        "optimizer": False,
        "imported_from": str(hf_dir.resolve()),
        **({"tokenizer": str(tokenizer.resolve())} if tokenizer.exists() else {}),
        **(meta or {}),
        "files": files,
        "tensors": tensors,
    }
    fsync_write(tmp / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)
    os.replace(tmp, final)
    fsync_write(dst / LATEST, final.name.encode())
    fsync_dir(dst)
    return final


def _write_pieces(hf_dir: Path, tmp: Path, config: ModelConfig, hf: dict, shapes: dict, cast) -> tuple[dict, dict]:
    """One checkpoint file per HF weight file, each logical tensor whole; returns the index's files and tensors."""
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    with HFWeights(hf_dir) as weights:
        sources = {name: hf_source(name, weights, hf, config) for name in shapes}
        by_file: dict[str, list[str]] = {}
        for name, src in sources.items():
            by_file.setdefault(weights.file_of(src.key + MXFP4_SUFFIXES[0] * src.mxfp4), []).append(name)
        for k, (hf_file, names) in enumerate(sorted(by_file.items())):
            names.sort(key=lambda n: (_offset(weights, sources[n]), n))  # read in order
            file = f"model-{k:05d}.safetensors"
            keys = {name: f"{name}@{region_key(tuple((0, n) for n in shapes[name]))}" for name in names}
            entries = {}
            for name in names:
                src = sources[name]
                stored = torch.bfloat16 if src.mxfp4 else weights.reader(src.key).dtype(src.key)  # exact in bf16
                entries[keys[name]] = (cast or stored, shapes[name])
            writer = TensorWriter(tmp / file, entries)
            for name in names:
                value = _read_source(weights, sources[name], name, config)
                if tuple(value.shape) != shapes[name]:
                    raise CheckpointError(
                        f"{hf_dir / hf_file}: {sources[name].key} has shape {tuple(value.shape)}, the model described "
                        f"by {CONFIG_NAME} needs {shapes[name]}; the directory's config and weights disagree"
                    )
                writer.write(keys[name], value)
                del value
            files[file] = writer.close()
            for name in names:
                region = [[0, n] for n in shapes[name]]
                tensors[name] = {
                    "global_shape": list(shapes[name]),
                    "pieces": [{"file": file, "key": keys[name], "region": region}],
                }
    return files, tensors


def _offset(weights: HFWeights, src) -> int:
    key = src.key + MXFP4_SUFFIXES[0] * src.mxfp4
    return weights.reader(key).offset(key)


def _read_source(weights: HFWeights, src, name: str, config: ModelConfig) -> torch.Tensor:
    reader = None if src.mxfp4 else weights.reader(src.key)
    if src.fused_part is not None:  # GPT-OSS: one expert of the fused tensor (MXFP4: dequantised), gate or up
        if src.mxfp4:
            blocks, scales = (weights.reader(src.key + s).read(src.key + s, (src.expert,)) for s in MXFP4_SUFFIXES)
            return expert_from_fused(mxfp4_expert(blocks, scales), src.fused_part).contiguous()
        return expert_from_fused(reader.read(src.key, (src.expert,)), src.fused_part).contiguous()
    if src.expert is not None:
        return reader.read(src.key, (src.expert,), src.rows)
    value = reader.read(src.key)
    return rope_rows_from_hf(name, value, config.mla) if src.interleaved else value


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def export_hf_dir(
    ckpt: str | Path,
    index: dict,
    out: str | Path,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    dtype: str | None = None,
) -> dict:
    """Write checkpoint ``ckpt`` (``index``: its index, read and verified by the caller; any layout) as an HF
    directory ``out``: ``config.json``, weights in shards of at most ``max_shard_size``, and the tokenizer files
    the checkpoint recorded. ``dtype``: ``bf16`` | ``fp32`` | None (as the checkpoint holds each tensor).
    Returns the ``config.json`` written."""
    ckpt, out = Path(ckpt), Path(out)
    config = model_config_of(index)
    names = sorted(index["tensors"], key=_natural)
    stored = _stored_dtypes(ckpt, index, names)
    cast = DTYPE_NAMES[dtype] if dtype else None
    hf_config = config_to_hf(config, cast or stored[names[0]])  # refused here, before anything is written
    kind = hf_config["model_type"]
    fused = fused_experts_of(names, config.layers) if kind in GPT_OSS_TYPES else {}
    whole = [n for n in names if not any(n in group for group in fused.values())]
    key_of = {name: hf_name(name, kind, config.layers) for name in whole}
    name_of = {key: name for name, key in key_of.items()}
    entries = {key_of[n]: (cast or stored[n], tuple(index["tensors"][n]["global_shape"])) for n in whole}
    for key, group in fused.items():  # GPT-OSS: each layer's experts fused, as transformers holds them
        shapes = [torch.Size(index["tensors"][n]["global_shape"]) for n in group]
        probe = fused_value(key, [torch.empty(shape, device="meta") for shape in shapes])
        entries[key] = (cast or stored[group[0]], tuple(probe.shape))

    readers: dict[str, TensorReader] = {}

    def value_of(key: str) -> torch.Tensor:
        if key in fused:
            return fused_value(key, [read_whole(ckpt, index["tensors"][n], n, readers) for n in fused[key]])
        name = name_of[key]
        value = read_whole(ckpt, index["tensors"][name], name, readers)
        return rope_rows_to_hf(name, value, config.mla) if kind in DEEPSEEK_TYPES else value

    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    try:
        write_hf_weights(out, entries, value_of, max_shard_size)
    finally:
        for reader in readers.values():
            reader.close()
    copy_tokenizer(index, out)
    return hf_config


def read_whole(ckpt: Path, entry: dict, name: str, readers: dict[str, TensorReader]) -> torch.Tensor:
    """A logical tensor assembled from its pieces (any layout), each read with plain reads: one whole piece is
    returned as read; otherwise each piece is copied into place and dropped (one copy of the tensor plus its
    largest piece resident). ``readers``: open files by name, kept between calls."""
    shape = tuple(entry["global_shape"])
    result, covered = None, 0
    for piece in entry["pieces"]:
        file = check_file_name(piece["file"], "piece")
        if file not in readers:
            readers[file] = TensorReader(ckpt / file)
        region = [tuple(r) for r in piece["region"]]
        want = tuple(b - a for a, b in region)
        if readers[file].shape(piece["key"]) != want:
            raise CheckpointError(f"{ckpt / file}: {piece['key']!r:.80} has a shape other than its region's")
        chunk = readers[file].read(piece["key"])
        if want == shape and len(entry["pieces"]) == 1:
            return chunk
        if result is None:
            result = torch.empty(shape, dtype=chunk.dtype)
        result[tuple(slice(a, b) for a, b in region)] = chunk
        covered += chunk.numel()
        del chunk
    if result is None or covered < math.prod(shape):
        raise CheckpointError(f"{ckpt}: the pieces of {name} do not cover it")
    return result


def _stored_dtypes(ckpt: Path, index: dict, names: list[str]) -> dict[str, torch.dtype]:
    readers: dict[str, TensorReader] = {}
    try:
        out = {}
        for name in names:
            piece = index["tensors"][name]["pieces"][0]
            if piece["file"] not in readers:
                readers[piece["file"]] = TensorReader(ckpt / piece["file"])
            out[name] = readers[piece["file"]].dtype(piece["key"])
        return out
    finally:
        for reader in readers.values():
            reader.close()


def copy_tokenizer(index: dict, out: Path) -> list[str]:
    """Copy the tokenizer file a checkpoint recorded (``tokenizer.json``) and its companions beside it
    (``tokenizer_config.json``, ``special_tokens_map.json``) into ``out``; returns the names copied."""
    recorded = index.get("tokenizer")
    if not recorded or not Path(recorded).is_file():
        return []
    source = Path(recorded)
    copied = []
    for name in TOKENIZER_FILES:
        src = source if name == "tokenizer.json" else source.with_name(name)
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    return copied
