"""modelpar-generate decodes with the tokenizer the checkpoint's training data was prepared with, and never
prints ids the byte tokenizer cannot decode as bytes."""

from __future__ import annotations

import torch

from modelpar.cli import generate as generate_cli
from modelpar.data import load_tokenizer, tokenizer_spec, train_bpe
from modelpar.model.config import ModelConfig
from tests.helpers import save_whole_model_checkpoint

MODEL = ModelConfig(vocab_size=300, hidden=32, layers=1, heads=4, kv_heads=2, ffn_hidden=24)


def test_the_checkpoints_tokenizer_decodes_by_default(tmp_path, capsys):
    tok = train_bpe(["def main(): return tea and stone " * 40], 300)
    tok.save(tmp_path / "mine.tokenizer.json")
    ckpt = save_whole_model_checkpoint(tmp_path / "ckpt", MODEL, tokenizer=str(tmp_path / "mine.tokenizer.json"))
    assert generate_cli.main([str(ckpt), "--prompt", "def main(", "--tokens", "8"]) == 0
    tok = load_tokenizer(tmp_path / "mine.tokenizer.json")
    model = generate_cli.load_single_device_model(ckpt)
    ids = generate_cli.generate(model, torch.as_tensor(tok.encode("def main("), dtype=torch.int64), 8)
    assert capsys.readouterr().out == tok.decode(ids) + "\n"


def test_ids_above_a_byte_are_refused_under_the_byte_tokenizer(tmp_path, capsys, monkeypatch):
    ckpt = save_whole_model_checkpoint(tmp_path / "ckpt", MODEL)  # no tokenizer recorded
    monkeypatch.setattr(generate_cli, "generate", lambda model, prompt, *a: torch.cat([prompt, torch.tensor([299])]))
    assert generate_cli.main([str(ckpt), "--tokens", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "token id 299, which the byte tokenizer cannot decode" in captured.err


def test_a_shard_directory_names_its_tokenizer_file(tmp_path):
    from modelpar.cli.data import main as data_main

    text = tmp_path / "notes.jsonl"
    text.write_text('{"text": "tea and stone"}\n' * 50)
    assert data_main(["prepare", str(text), "--output", str(tmp_path / "web"), "--no-progress"]) == 0
    assert tokenizer_spec(tmp_path / "web") == "byte"
