"""Golden loss curves: each family's tiny model, trained 20 steps on one device, gives exactly the committed
losses. A change that moves every layout alike (the init, a layer, the optimizer, the data order) shows up here,
and in review as a changed ``golden/losses.json``. After a deliberate change, regenerate the file with

    MODELPAR_GOLDEN=write .venv/bin/python -m pytest tests/training/test_golden_losses.py

and say in the change why the curves moved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelpar.testing import run_on_ranks
from tests.training.families import FAMILIES, family_config, token_file, train_families

GOLDEN = Path(__file__).with_name("golden") / "losses.json"
STEPS = 20


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("golden")
    configs = {family: family_config(model, tmp / family, STEPS) for family, model in FAMILIES.items()}
    trained = run_on_ranks(1, train_families, configs, token_file(tmp), timeout_s=300)[0]
    got = {family: result["losses"] for family, result in trained.items()}
    if os.environ.get("MODELPAR_GOLDEN") == "write":
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_the_first_20_losses_equal_the_committed_curve(curves, family):
    golden = json.loads(GOLDEN.read_text())
    assert family in golden, f"no golden curve for {family}: regenerate with MODELPAR_GOLDEN=write (see the docstring)"
    assert len(golden[family]) == STEPS
    assert curves[family] == golden[family], f"{family}: the loss curve moved (see the docstring to regenerate)"


def test_every_family_has_a_curve_and_no_curve_is_stale():
    assert sorted(json.loads(GOLDEN.read_text())) == sorted(FAMILIES)
