"""modelpar-ckpt export-hf: refused before anything is written, complete or absent, named for what it wrote."""

from __future__ import annotations

import stat

from modelpar.cli.ckpt import main as ckpt_main
from modelpar.model.config import ModelConfig, MoEConfig
from tests.helpers import save_whole_model_checkpoint


def _checkpoint(root, moe: MoEConfig):
    config = ModelConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=24, moe=moe)
    return save_whole_model_checkpoint(root, config)


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


def test_help_names_every_family(capsys):
    try:
        ckpt_main(["--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    families = "a Llama, Mistral, Mixtral, Qwen3(-MoE) or DeepSeek-V3 directory"
    assert f"import-hf {families} -> checkpoint" in text and f"export-hf checkpoint -> {families}" in text
