"""The tested torch range is one fact: pyproject states it, the CPU pin lies in it, and start-up refuses a torch
outside it in one line unless told to run anyway."""

from __future__ import annotations

import re

import pytest
import torch

from modelpar.training.torch_version import ALLOW_ENV, TESTED_TORCH, UntestedTorchError, check_torch_version
from tests.helpers import ROOT


def test_pyproject_requires_the_tested_range_and_the_cpu_pin_lies_in_it():
    (first, last) = TESTED_TORCH
    spec = f'"torch>={first[0]}.{first[1]},<{last[0]}.{last[1]}"'
    assert spec in (ROOT / "pyproject.toml").read_text()
    pin = re.search(r"^torch==(\d+)\.(\d+)", (ROOT / "constraints" / "cpu.txt").read_text(), re.M)
    assert first <= (int(pin[1]), int(pin[2])) < last


def test_this_torch_is_tested():
    check_torch_version(torch.__version__, environ={})


def test_an_untested_torch_is_one_line_with_a_way_to_proceed():
    with pytest.raises(UntestedTorchError) as err:
        check_torch_version("2.4.1+cu121", environ={})
    assert "\n" not in str(err.value) and f"{ALLOW_ENV}=1" in str(err.value) and "torch 2.4.1+cu121" in str(err.value)
    check_torch_version("2.4.1+cu121", environ={ALLOW_ENV: "1"})
