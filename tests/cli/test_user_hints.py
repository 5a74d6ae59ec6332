"""Hints a new user gets in one line: a typo under a section, a typo in a recipe choice, a batch that does not
split over dp; and a default setting that stays quiet where its limit is moot."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from modelpar.cli.overrides import recipe_groups, unknown_choice, unknown_override
from modelpar.training.config import RECIPES, RecipeError, TrainConfig, validate
from modelpar.training.outliers import outlier_check_note
from tests import warm_cli
from tests.helpers import make_config

ROOT = Path(__file__).resolve().parents[2]
GROUPS = recipe_groups(RECIPES)


def test_an_unknown_key_under_a_section_is_never_answered_with_the_section_itself():
    assert unknown_override(["+trainer.foo=1"], TrainConfig, GROUPS) == (
        "trainer.foo is not a recipe key; see the keys of trainer with --cfg job"
    )
    assert unknown_override(["trainer.stepz=3"], TrainConfig, GROUPS).endswith("did you mean trainer.steps?")


def test_a_typo_in_a_recipe_choice_is_one_line_naming_the_closest():
    problem = unknown_choice(["model=llama8b"], RECIPES, GROUPS)
    assert problem.startswith("model=llama8b is not a model recipe; did you mean model=llama-8b? (one of ")
    assert unknown_choice(["model=tiny,llama-1b", "parallel=tp2"], RECIPES, GROUPS) is None
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", "model=llama8b"], capture_output=True, text=True, timeout=120,
        cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "did you mean model=llama-8b?" in lines[0], proc.stderr


def test_a_global_batch_that_does_not_split_over_dp_says_what_would(tmp_path):
    cfg = make_config(tmp_path, dp=3)  # two micro-batches
    cfg = replace(cfg, data=replace(cfg.data, global_batch=16))
    with pytest.raises(RecipeError, match=r"try data\.global_batch=18 \(a multiple of .* = 6\)$"):
        validate(cfg)


def test_the_default_outlier_check_says_nothing_at_dp2():
    assert outlier_check_note("warn", 2, 0) is None
    assert "cannot say which one is odd" in outlier_check_note("halt", 2, 0)
