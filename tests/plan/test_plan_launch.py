"""The planner's launch line runs as printed on GPUs: torchrun on every node, the GPU trainer recipe, a token file
to name, and overrides that compose into a valid recipe."""

from __future__ import annotations

import shlex
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from modelpar.cli.plan import main
from modelpar.training.config import register_schema, validate

ROOT = Path(__file__).resolve().parents[2]


def test_the_launch_line_composes_into_the_gpu_recipe_of_the_planned_layout(tmp_path, capsys):
    argv = ["--model", "llama-8b", "--gpus", "64", "--global-batch", "256", "--seq-len", "1024", "--tp", "2", "--pp"]
    assert main([*argv, "4", "--top", "1"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("launch #1: ")]
    words = shlex.split(line.removeprefix("launch #1: ").split("  # ")[0].replace("$HEAD", "head"))
    assert words[:4] == ["torchrun", "--nnodes=8", "--nproc-per-node=8", "--rdzv-endpoint=head:29500"]
    overrides = words[words.index("modelpar.cli.train") + 1 :]
    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=[*overrides, f"trainer.out_dir={tmp_path}"]))
    layout = validate(cfg)
    assert (cfg.trainer.device, cfg.trainer.dtype, cfg.data.path) == ("cuda", "bf16", "YOUR_TOKENS.npy")
    assert layout.world_size == 64 and (layout.tp, layout.pp) == (2, 4)


def test_a_cpu_plan_prints_no_launch_line(capsys):
    argv = ["--model", "tiny", "--gpus", "4", "--global-batch", "16", "--seq-len", "64", "--hardware", "cpu"]
    assert main(argv) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("launch #1")]
