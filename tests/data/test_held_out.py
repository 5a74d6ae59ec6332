"""A held-out split is never quietly empty: a fraction > 0 holds out at least one document, and a split too
small for modelpar-eval's default windows is said at prepare time, naming --val-fraction."""

from __future__ import annotations

import json

from modelpar.cli.data import main as data_main
from modelpar.data.prepare_shards import is_held_out
from modelpar.data.shards import read_manifest


def test_a_tiny_fraction_of_a_small_corpus_still_holds_out_a_document():
    assert [d for d in range(400) if is_held_out(d, 0.001)] == [0]
    assert sum(is_held_out(d, 0.1) for d in range(400)) == 40  # the fraction itself is unchanged


def test_prepare_warns_of_a_held_out_split_too_small_to_evaluate(tmp_path, capsys):
    notes = tmp_path / "notes.jsonl"
    notes.write_text("".join(json.dumps({"text": f"note {i}: tea and stone"}) + "\n" for i in range(400)))
    assert data_main(["prepare", str(notes), "--output", str(tmp_path / "web"), "--val-fraction", "0.001",
                      "--no-progress"]) == 0  # fmt: skip
    assert read_manifest(tmp_path / "web" / "val")["documents"] == 1
    err = capsys.readouterr().err
    assert "warning: the held-out split has" in err and "raise --val-fraction (now 0.001)" in err
