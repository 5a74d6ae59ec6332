"""benchmarks/fp8_curve.py's measure: the seed-mean held-out curve at every 25th step, against fp8=off."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_curve.py"


@pytest.fixture(scope="module")
def curve():
    spec = importlib.util.spec_from_file_location("fp8_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_goal_measure_is_the_seed_mean_held_out_loss_at_the_marks(curve):
    steps = 50
    held = {  # two seeds; step 40 is not a mark and is never looked at
        "off": [{0: 5.0, 25: 3.0, 40: 1.0, 50: 2.0}, {0: 5.0, 25: 3.0, 40: 1.0, 50: 2.0}],
        "rowwise": [{0: 5.0, 25: 3.06, 40: 9.0, 50: 2.0}, {0: 5.0, 25: 3.0, 40: 9.0, 50: 2.02}],
        "tensorwise": [{0: 5.0, 25: 3.0, 40: 9.0, 50: 2.0}, {0: 5.0, 25: 3.0, 40: 9.0, 50: 2.0}],
    }
    train = {mode: [[4.0] * steps, [4.0] * steps] for mode in held}
    train["rowwise"][0][24] = 4.4  # seed 0's step 25: 10% off, reported but not the goal's measure
    worst = curve.worst(held, train, steps)
    assert worst["rowwise"]["held_out_seed_mean"] == pytest.approx(0.01)  # (3.06 + 3.0) / 2 against 3.0
    assert worst["rowwise"]["held_out_any_seed"] == pytest.approx(0.02)
    assert worst["rowwise"]["train_loss_seed0"] == pytest.approx(0.1)
    assert worst["tensorwise"] == {"held_out_seed_mean": 0.0, "held_out_any_seed": 0.0, "train_loss_seed0": 0.0}
    table = curve.markdown(held, train, steps).splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == ["| 0", "| 25", "| 50"]
    assert "+1.00%" in table[3] and "4.4000" in table[3]
