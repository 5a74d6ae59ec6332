"""A command-line key the recipe does not have is refused in one line naming the closest real key."""

from __future__ import annotations

import sys

import pytest

from modelpar.cli.overrides import recipe_groups, unknown_override
from modelpar.training.config import RECIPES, TrainConfig
from tests import warm_cli

GROUPS = recipe_groups(RECIPES)


@pytest.mark.parametrize(
    ("override", "closest"),
    [
        ("parallel.tpp=2", "parallel.tp"),
        ("+parallel.tpp=2", "parallel.tp"),
        ("+trainer.stepz=3", "trainer.steps"),
        ("++model.moe.expert=4", "model.moe.experts"),
    ],
)
def test_an_unknown_key_names_the_closest_real_one(override, closest):
    problem = unknown_override([override], TrainConfig, GROUPS)
    assert problem == f"{override.split('=')[0].lstrip('+')} is not a recipe key; did you mean {closest}?"


def test_real_keys_group_choices_and_hydra_options_pass():
    argv = ["-m", "parallel=single,tp2", "model=tiny", "model.moe.experts=4", "data.blend=[{path: a}]",
            "+data.blend[0].weight=2", "hydra.run.dir=/tmp/x", "hydra/launcher=basic", "trainer.steps=3"]  # fmt: skip
    assert unknown_override(argv, TrainConfig, GROUPS) is None


@pytest.mark.parametrize("cli", ["train", "eval"])
def test_the_cli_refuses_a_typo_in_one_line_before_any_work(cli, tmp_path):
    proc = warm_cli.run(
        [sys.executable, "-m", f"modelpar.cli.{cli}", "+trainer.stepz=3", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    expected = f"modelpar-{cli}: error: trainer.stepz is not a recipe key; did you mean trainer.steps?"
    assert proc.stderr.strip() == expected
    assert not any(tmp_path.iterdir())  # no run directory, no job


def test_bench_refuses_a_typo_in_one_line_before_any_work(tmp_path):
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.bench", "+bench.roundz=3", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "modelpar-bench: error: bench.roundz is not a recipe key; did you mean bench.rounds?"
    assert not any(tmp_path.iterdir())
