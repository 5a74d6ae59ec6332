"""A prepare refused for its data leaves no output directory behind (no empty val/, no .partial files)."""

from __future__ import annotations

from modelpar.cli.data import main


def test_a_refused_prepare_leaves_nothing(tmp_path, capsys):
    source = tmp_path / "a.jsonl"
    source.write_text('{"body": "hello"}\n{"body": "x"}\n')
    out = tmp_path / "out"
    assert main(["prepare", str(source), "--output", str(out), "--val-fraction", "0.5", "--no-progress"]) == 2
    assert "pass --text-key" in capsys.readouterr().err
    assert not out.exists()


def test_a_refused_prepare_into_an_existing_directory_leaves_it_alone(tmp_path):
    source = tmp_path / "a.jsonl"
    source.write_text('{"body": "hello"}\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    assert main(["prepare", str(source), "--output", str(out), "--no-progress"]) == 2
    assert (out / "mine.txt").read_text() == "kept"
