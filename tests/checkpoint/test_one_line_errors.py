"""A checkpoint that cannot be used is one line wherever it is found, in a rank too (never a traceback)."""

from __future__ import annotations

import pytest

from modelpar.checkpoint.store import CheckpointError
from modelpar.parallel.launch import LaunchError, launch


def _load_a_missing_tensor() -> None:
    raise CheckpointError("ckpt/step-00000001 has no tensor 'layers.0.mlp.gate_proj.weight'")


def test_a_checkpoint_error_in_a_rank_is_reported_as_its_message_alone():
    with pytest.raises(LaunchError) as err:
        launch(1, _load_a_missing_tensor, timeout_s=60)
    lines = str(err.value).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith("CheckpointError: ckpt/step-00000001 has no tensor 'layers.0.mlp.gate_proj.weight'")
