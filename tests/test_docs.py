"""The README and the guides tell the truth: every `modelpar-train` command they print composes with the
recipes and passes the checks that run before any rank starts, and every file they link exists."""

from __future__ import annotations

import re
import shlex

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from modelpar.training.config import register_schema
from modelpar.training.preflight import check_recipe
from tests.helpers import RECIPES, ROOT

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands() -> list[tuple[str, str]]:
    """(page, command line) for each modelpar-train line of a bash block, continuation lines joined."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].strip()
                if "modelpar-train" in line or "modelpar.cli.train" in line:
                    found.append((page.name, line))
    return found


def _overrides(line: str) -> tuple[str, list[str]]:
    words = shlex.split(line)
    start = next(i for i, w in enumerate(words) if w.endswith("modelpar-train") or w == "modelpar.cli.train")
    config_name, overrides, rest = "train", [], words[start + 1 :]
    while rest:
        word = rest.pop(0)
        if word == "--config-name":
            config_name = rest.pop(0)
        elif not word.startswith("hydra.") and not word.startswith("-"):
            overrides.append(word)
    return config_name, overrides


COMMANDS = _commands()


def test_the_pages_print_training_commands():
    assert len(COMMANDS) >= 20  # the README's and the guides' commands, not an empty scan


@pytest.mark.parametrize("page,line", COMMANDS, ids=[f"{p}:{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_each_printed_training_command_passes_the_recipe_checks(page, line):
    config_name, overrides = _overrides(line)
    if any("," in o.split("=", 1)[-1] and "[" not in o and "{" not in o for o in overrides):
        overrides = [o.split(",")[0] if "," in o and "[" not in o else o for o in overrides]  # multirun: first job
    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name=config_name, overrides=[*overrides, "trainer.out_dir=unused"]))
    check_recipe(cfg)


def test_every_relative_link_names_a_file_that_exists():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"
