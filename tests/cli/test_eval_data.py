"""modelpar-eval given no data scores what the checkpoint was trained on, or refuses; it says what it scored."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from modelpar.cli.eval import data_of_checkpoint
from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError
from tests import warm_cli
from tests.helpers import make_config, train_and_collect

ROOT = Path(__file__).resolve().parents[2]


def test_the_recorded_training_data_is_scored_when_none_is_given(tmp_path):
    cfg = make_config(tmp_path)
    got, note = data_of_checkpoint(cfg, {"data": {"path": "/data/shards"}}, Path("ck"))
    assert got.data.path == "/data/shards" and "what ck trained on" in note
    got, _ = data_of_checkpoint(cfg, {"data": {"blend": [["/a", 0.7], ["/b", 0.3]]}}, Path("ck"))
    assert [(e.path, e.weight) for e in got.data.blend] == [("/a", 0.7), ("/b", 0.3)]
    given = replace(cfg, data=replace(cfg.data, path="/mine"))
    assert data_of_checkpoint(given, {"data": {"path": "/data/shards"}}, Path("ck")) == (given, "")


def test_a_checkpoint_that_records_no_data_is_refused_rather_than_scored_on_the_default_corpus(tmp_path):
    with pytest.raises(RecipeError, match=r"does not record the data it was trained on .* pass data\.path="):
        data_of_checkpoint(make_config(tmp_path), {}, Path("ck"))


def test_eval_without_data_scores_the_checkpoints_training_data_and_says_so(token_path, tmp_path):
    cfg = make_config(tmp_path, microbatches=1)
    cfg = replace(cfg, model=replace(cfg.model, layers=2), trainer=replace(cfg.trainer, steps=1))
    run_on_ranks(1, train_and_collect, cfg, token_path, None, (1,))
    index = json.loads((tmp_path / "checkpoints" / "step-00000001" / "index.json").read_text())
    assert index["data"] == {"path": str(Path(token_path).resolve())}
    common = [sys.executable, "-m", "modelpar.cli.eval", f"eval.checkpoint={tmp_path / 'checkpoints'}",
              "eval.windows=4", "data.seq_len=16", "parallel=single", "parallel.microbatches=1"]  # fmt: skip
    runs = [
        warm_cli.run([*common, *extra], capture_output=True, text=True, timeout=180, cwd=ROOT)
        for extra in ([], [f"data.path={token_path}"])
    ]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    recorded, given = (proc.stdout.strip().splitlines() for proc in runs)
    assert recorded[0] == f"modelpar-eval: scoring {Path(token_path).resolve()} (the held-out split of what " + (
        f"{tmp_path / 'checkpoints' / 'step-00000001'} trained on)"
    )
    assert given[0] == f"modelpar-eval: scoring {token_path}"
    assert json.loads(recorded[-1])["eval_loss"] == json.loads(given[-1])["eval_loss"]
