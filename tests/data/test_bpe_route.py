"""The BPE route of docs/data.md end to end: a BPE trained by prepare has an end-of-text token, so a shard
directory can be prepared with it; a jsonl prepared into a token file is tokenised by its records' text field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from modelpar.data.prepare import prepare
from modelpar.data.prepare_shards import prepare_shards
from modelpar.data.tokenizer import load_tokenizer, train_bpe

pytest.importorskip("tokenizers")

DOCS = [f"Record {i}: the quick brown fox jumps over the lazy dog {i * 7} times.\n" for i in range(60)]


def test_a_trained_bpe_has_an_end_of_text_token_that_ordinary_text_does_not_encode_to():
    bpe = train_bpe(DOCS, 300)
    assert bpe.eos_id is not None
    assert bpe.backend.id_to_token(bpe.eos_id) == "<|endoftext|>"
    assert bpe.eos_id not in bpe.encode("".join(DOCS)).tolist()


def test_a_jsonl_prepared_into_a_token_file_is_its_text_fields(tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    info = prepare([source], tmp_path / "x.npy", tokenizer="bpe", vocab_size=300)
    ids = np.load(tmp_path / "x.npy")
    text = load_tokenizer(info.tokenizer_path).decode(ids)
    assert text == "".join(DOCS)
    byte_ids = np.load(prepare([source], tmp_path / "b.npy").path)
    assert bytes(byte_ids.astype(np.uint8).tolist()).decode() == "".join(DOCS)


def test_the_trained_tokenizer_prepares_a_shard_directory(tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    info = prepare([source], tmp_path / "x.npy", tokenizer="bpe", vocab_size=300)
    prepare_shards([source], tmp_path / "shards", tokenizer=str(info.tokenizer_path))
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["tokenizer"]["eos_id"] == load_tokenizer(info.tokenizer_path).eos_id
    assert sum(shard["documents"] for shard in manifest["shards"]) == len(DOCS)
