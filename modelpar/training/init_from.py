"""Continued pretraining: a fresh run whose first weights are a modelpar checkpoint's or a Hugging Face
directory's (``trainer.init_from=PATH``).

    modelpar-train trainer.init_from=hf/Llama-3.2-1B data.path=data/web parallel=tp2-pp2

The run starts at step 0 with new optimizer state, the recipe's LR schedule and its data; only the weights
are taken, each rank reading just the regions it holds from the files (no conversion step, no rank holding
the whole model). The model's identity is the source's: ``modelpar-train`` replaces the recipe's ``model.*``
with it before any rank starts. Once the run has saved a checkpoint of its own, ``trainer.resume=auto``
resumes from that instead, so a rerun or an automatic restart never goes back to the source's weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from modelpar.checkpoint.reshard import load_model_from_checkpoint, load_model_regions
from modelpar.checkpoint.signing import read_signed_index
from modelpar.checkpoint.store import Piece, read_index, resolve_checkpoint
from modelpar.model.config import ModelConfig
from modelpar.model.hf import CONFIG_NAME, config_from_hf, hf_source, hf_value
from modelpar.model.hf_files import INDEX_FILE, SINGLE_FILE, HFWeights
from modelpar.model.transformer import ModelChunk
from modelpar.training.config import RecipeError


@dataclass(frozen=True)
class InitSource:
    """What ``trainer.init_from`` names: ``path`` (a checkpoint's step directory, ``latest`` followed, or an HF
    directory), ``kind`` (``checkpoint`` | ``hf``) and ``model``, the identity of its weights (``ModelConfig``
    fields, as a checkpoint's index records them)."""

    path: Path
    kind: str
    model: dict

    def describe(self) -> str:
        what = "Hugging Face directory" if self.kind == "hf" else "checkpoint"
        return f"{self.model.get('name', '?')} from the {what} {self.path}"


def is_hf_dir(path: Path) -> bool:
    return (path / CONFIG_NAME).exists() and ((path / SINGLE_FILE).exists() or (path / INDEX_FILE).exists())


def init_source(path: str | Path, key: bytes | None = None, verify: bool = True) -> InitSource:
    """Describe (and with ``verify``, check: every hash and the signature of a checkpoint, the files of an HF
    directory) what ``trainer.init_from`` names; one-line errors naming the path."""
    path = Path(path)
    if not path.is_dir():
        raise RecipeError(f"trainer.init_from={path}: no such directory; name a checkpoint or a Hugging Face directory")
    if is_hf_dir(path):
        config = replace(config_from_hf(path), name=path.name)
        if verify:
            HFWeights(path).close()  # missing, extra or truncated files named before any rank starts
        return InitSource(path, "hf", asdict(config))
    ckpt = resolve_checkpoint(path)
    index = read_signed_index(ckpt, key) if verify else read_index(ckpt, verify=False)
    return InitSource(ckpt, "checkpoint", index["model"])


def load_initial_weights(chunks: list[ModelChunk], source: InitSource) -> None:
    """This rank's regions of every logical tensor of ``chunks`` from ``source`` (any layout, any ZeRO stage)."""
    if source.kind == "checkpoint":
        load_model_from_checkpoint(chunks, source.path, read_index(source.path, verify=False))
    else:
        load_model_regions(chunks, lambda wanted: hf_regions(source.path, chunks[0].config, wanted))


def hf_regions(hf_dir: Path, config: ModelConfig, wanted: list[Piece]) -> dict[Piece, torch.Tensor]:
    """Each wanted region of a logical tensor, read from an HF directory's files (only its rows where it can)."""
    hf = json.loads((hf_dir / CONFIG_NAME).read_text())
    with HFWeights(hf_dir) as weights:
        out = {}
        for piece in wanted:
            index = tuple(slice(a, b) for a, b in piece.region)
            src = hf_source(piece.name, weights, hf, config)
            out[piece] = hf_value(weights, src, piece.name, config, index)
        return out
