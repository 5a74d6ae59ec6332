"""modelpar-ckpt export-hf: refused before anything is written, complete or absent, named for what it wrote."""

from __future__ import annotations

import stat
from dataclasses import asdict

import torch

from modelpar.checkpoint.reshard import model_pieces
from modelpar.checkpoint.store import save_checkpoint
from modelpar.cli.ckpt import main as ckpt_main
from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.model.transformer import build_model
from modelpar.parallel.layout import ParallelLayout
from modelpar.training.config import ParallelConfig


def _checkpoint(root, moe: MoEConfig):
    config = ModelConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=24, moe=moe)
    meta = {"layout": asdict(ParallelLayout()), "model": asdict(config), "parallel": asdict(ParallelConfig()),
            "world_size": 1, "sampler": None, "optimizer": False}  # fmt: skip
    pieces = model_pieces([build_model(config, seed=0)])
    return save_checkpoint(root, 0, pieces, {"rng/torch": torch.get_rng_state()}, meta)


def test_a_refused_export_leaves_nothing_and_a_retry_into_the_same_directory_works(tmp_path, capsys):
    out = tmp_path / "hf"
    partial = _checkpoint(tmp_path / "partial", MoEConfig(experts=4, layers=[1]))
    assert ckpt_main(["export-hf", str(partial), str(out)]) == 2
    assert "Mixtral cannot express this model (MoE in only some layers)" in capsys.readouterr().err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]
    every = _checkpoint(tmp_path / "every", MoEConfig(experts=4))
    assert ckpt_main(["export-hf", str(every), str(out)]) == 0
    assert "as a MixtralForCausalLM directory" in capsys.readouterr().out
    modes = {stat.S_IMODE((out / name).stat().st_mode) for name in ("config.json", "model.safetensors")}
    assert len(modes) == 1, modes  # the weights are as readable as the config


def test_help_names_both_families(capsys):
    try:
        ckpt_main(["--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "LlamaForCausalLM or MixtralForCausalLM directory -> checkpoint" in text
    assert "MixtralForCausalLM for a mixture of experts" in text
