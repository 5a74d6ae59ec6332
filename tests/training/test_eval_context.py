"""modelpar-eval of an imported Hugging Face model with each window split over cp ranks gives transformers' loss."""

from __future__ import annotations

import json

import pytest

from tests.training.test_eval_hf import WINDOWS, eval_cli, imported  # noqa: F401  (the fixture)

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "layout", [["parallel.cp=2"], ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm=allgather"]]
)
def test_eval_at_cp_gives_transformers_loss(imported, layout):  # noqa: F811
    root, want = imported
    proc = eval_cli(
        f"eval.checkpoint={root / 'ckpt'}", f"data.path={root / 'tokens.npy'}", f"eval.windows={WINDOWS}",
        "parallel=single", "parallel.microbatches=2", *layout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
