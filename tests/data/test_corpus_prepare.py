"""Streaming prepare: corpus formats, worker processes, shards and manifest, resuming, bad records, bad input."""

import gzip
import json
import random

import numpy as np
import pytest

from modelpar.cli.data import main
from modelpar.data import DataError, open_dataset, prepare_shards, tokenizer_for, train_bpe
from modelpar.data.prepare_shards import is_held_out
from modelpar.data.shards import read_manifest
from modelpar.data.tokenizer import BPETokenizer

WORDS = ["alpha", "beta", "gamma", "δέλτα", "日本", "x = 1\n", "def f():", "    return"]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def write_zst(path, records):
    zstandard = pytest.importorskip("zstandard")
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    return path


def write_parquet(path, texts, key="text", row_group_size=37):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({key: texts, "id": list(range(len(texts)))}), path, row_group_size=row_group_size)
    return path


def shard_bytes(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.npy"))}


def all_tokens(folder) -> np.ndarray:
    return np.concatenate([np.load(folder / s["file"]) for s in read_manifest(folder)["shards"]])


def bpe_dir(tmp_path, eos="<|endoftext|>", config=True):
    """A Hugging Face-style tokenizer directory: tokenizer.json (+ tokenizer_config.json naming the EOS)."""
    folder = tmp_path / "tok"
    folder.mkdir()
    tok = train_bpe(documents(200, seed=9), 400) if eos == "<|endoftext|>" else _bpe_without_end_of_text()
    tok.backend.add_special_tokens([eos])
    tok.save(folder / "tokenizer.json")
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return folder


def _bpe_without_end_of_text() -> BPETokenizer:
    """A byte-level BPE as ``train_bpe`` makes one, less its end-of-text token (as some model directories ship)."""
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(documents(200, seed=9), trainer=trainer)
    return BPETokenizer(backend=backend)


def one_line(match, fn, *args, **kwargs) -> str:
    with pytest.raises(DataError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


# --- formats and tokens ----------------------------------------------------------------------------------------


def test_every_format_gives_the_documents_each_ended_by_eos(tmp_path):
    docs = documents(120)
    records = [{"text": d, "id": i} for i, d in enumerate(docs)]
    inputs = {
        "jsonl": write_jsonl(tmp_path / "c.jsonl", records),
        "gz": write_jsonl(tmp_path / "c.jsonl.gz", records, opener=gzip.open),
        "zst": write_zst(tmp_path / "c.jsonl.zst", records),
        "parquet": write_parquet(tmp_path / "c.parquet", docs),
    }
    expected = np.concatenate([np.frombuffer(d.encode() + b"\0", dtype=np.uint8) for d in docs]).astype(np.uint16)
    for name, path in inputs.items():
        out = tmp_path / f"out-{name}"
        m = prepare_shards([path], out, shard_tokens=1000).manifest
        np.testing.assert_array_equal(all_tokens(out), expected, err_msg=name)
        assert m["documents"] == len(docs) and m["tokens"] == len(expected)
        assert [s["tokens"] for s in m["shards"][:-1]] == [1000] * (len(m["shards"]) - 1)
        assert sum(s["documents"] for s in m["shards"]) == len(docs)
        assert m["settings"]["sources"] == [{"path": str(path), "size": path.stat().st_size}]
        assert m["tokenizer"] == {
            "kind": "byte",
            "fingerprint": "byte",
            "vocab_size": 256,
            "eos_id": 0,
            "file": None,
            "source": "byte",
        }


def test_text_files_are_one_document_each_read_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr("modelpar.data.records._PIECE_BYTES", 64)  # many pieces per file
    texts = ["\n".join(documents(30, seed=s)) + "\n" for s in range(3)]
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "in" / f"{i}.txt").write_text(text)
    (tmp_path / "in" / "notes.md").write_text("not a corpus file: a directory passes it over")
    m = prepare_shards([tmp_path / "in"], tmp_path / "out", shard_tokens=500, workers=0).manifest
    expected = b"".join(t.encode() + b"\0" for t in texts)
    assert all_tokens(tmp_path / "out").tobytes() == np.frombuffer(expected, np.uint8).astype(np.uint16).tobytes()
    assert m["documents"] == 3


def test_workers_and_batch_size_do_not_change_a_byte(tmp_path):
    tok_dir = bpe_dir(tmp_path)
    docs = documents(400)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    runs = {}
    for workers, batch in ((0, 1 << 20), (2, 700), (3, 5000)):
        out = tmp_path / f"w{workers}"
        m = prepare_shards([corpus], out, tokenizer=tok_dir, workers=workers, shard_tokens=900, batch_bytes=batch)
        runs[workers] = (shard_bytes(out), m.manifest)
    assert runs[0] == runs[2] == runs[3]
    tok = tokenizer_for(tmp_path / "w2")
    eos = tok.eos_id
    assert eos == tok.backend.token_to_id("<|endoftext|>") and runs[2][1]["tokenizer"]["eos_id"] == eos
    reference = tok.backend.encode_batch(docs, add_special_tokens=False)  # the plain call, offsets and all
    expected = np.concatenate([np.append(e.ids, eos) for e in reference])
    np.testing.assert_array_equal(all_tokens(tmp_path / "w2"), expected)
    assert tok.decode(expected[: len(tok.encode_documents(docs[:1])[0])]) == docs[0]


def test_held_out_split_takes_every_nth_document_into_its_own_shard_directory(tmp_path):
    docs = documents(200)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    m = prepare_shards([corpus], tmp_path / "out", shard_tokens=700, val_fraction=0.1).manifest
    held = [d for i, d in enumerate(docs) if is_held_out(i, 0.1)]
    kept = [d for i, d in enumerate(docs) if not is_held_out(i, 0.1)]
    assert len(held) == 20 and m["val"] == "val" and m["documents"] == 180
    val = read_manifest(tmp_path / "out" / "val")
    assert val["documents"] == 20 and val["split"] == "val"
    encode = lambda texts: np.frombuffer(b"".join(t.encode() + b"\0" for t in texts), np.uint8)
    np.testing.assert_array_equal(all_tokens(tmp_path / "out" / "val"), encode(held))
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), encode(kept))
    windows = open_dataset(tmp_path / "out" / "val", vocab_size=256, seq_len=32)
    assert windows.num_windows == sum((s["tokens"] - 1) // 32 for s in val["shards"] if s["tokens"] > 32)


# --- resuming --------------------------------------------------------------------------------------------------


def test_interrupted_prepare_resumes_to_the_same_bytes_and_a_finished_one_is_not_redone(tmp_path):
    tok_dir = bpe_dir(tmp_path)
    docs = documents(600)
    sources = [
        write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs[:250]]),
        write_parquet(tmp_path / "b.parquet", docs[250:]),
    ]
    settings = dict(tokenizer=tok_dir, shard_tokens=800, val_fraction=0.05)
    whole = prepare_shards(sources, tmp_path / "whole", workers=2, **settings)
    assert whole.done and len(whole.manifest["shards"]) > 6

    cut = tmp_path / "cut"
    first = prepare_shards(sources, cut, workers=2, batch_bytes=3000, stop_after_shards=3, **settings)
    assert not first.done and len(first.manifest["shards"]) == 3 and not first.manifest["complete"]
    with pytest.raises(DataError, match="unfinished prepare"):
        open_dataset(cut, vocab_size=512, seq_len=16)
    # what a killed process leaves: ids written after the last saved resume point, which must be dropped
    partial = next(cut.glob(".shard-*.partial"))
    with partial.open("ab") as f:
        f.write(b"\xff\xff" * 123)
    later = len(whole.manifest["shards"]) * 3 // 4  # into the parquet file
    second = prepare_shards(sources, cut, workers=1, batch_bytes=2000, stop_after_shards=later, **settings)
    assert not second.done and second.resumed and second.manifest["state"]["cursor"]["source"] == 1
    assert later <= len(second.manifest["shards"]) < len(whole.manifest["shards"])
    final = prepare_shards(sources, cut, workers=3, **settings)
    assert final.done and final.manifest == whole.manifest
    assert shard_bytes(cut) == shard_bytes(tmp_path / "whole")
    assert (cut / "manifest.json").read_bytes() == (tmp_path / "whole" / "manifest.json").read_bytes()
    assert not list(cut.rglob("*.partial"))

    stamps = {p: p.stat().st_mtime_ns for p in cut.rglob("*.npy")}
    again = prepare_shards(sources, cut, workers=2, **settings)
    assert again.already and {p: p.stat().st_mtime_ns for p in cut.rglob("*.npy")} == stamps


def test_rerun_with_other_settings_is_refused_naming_the_difference(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in documents(50)])
    prepare_shards([corpus], tmp_path / "out", shard_tokens=500)
    message = one_line("other settings", prepare_shards, [corpus], tmp_path / "out", shard_tokens=600)
    assert "shard_tokens 500 now 600" in message and "--overwrite" in message
    assert prepare_shards([corpus], tmp_path / "out", shard_tokens=600, overwrite=True).done


# --- bad records and bad input ---------------------------------------------------------------------------------


def test_bad_records_are_counted_not_fatal_unless_strict(tmp_path):
    lines = [
        json.dumps({"text": "good one"}),
        json.dumps({"body": "no text key"}),
        "{not json",
        json.dumps({"text": "   "}),
        json.dumps({"text": 42}),
        json.dumps({"text": "\ud800 lone surrogate"}),
        "",
        json.dumps({"text": "good two"}),
    ]
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes("\n".join(lines).encode() + b"\n" + b'{"text": "\xff\xfe"}\n')
    m = prepare_shards([corpus], tmp_path / "out").manifest
    assert m["bad_records"] == {"invalid_json": 1, "missing_key": 1, "not_text": 1, "not_utf8": 2, "empty": 2}
    assert m["documents"] == 2
    expected = np.frombuffer(b"good one\0good two\0", np.uint8).astype(np.uint16)
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), expected)
    message = one_line("record 2 is bad", prepare_shards, [corpus], tmp_path / "strict", strict=True)
    assert str(corpus) in message and "missing key" in message


def test_a_text_key_missing_from_every_record_is_one_line_suggesting_the_keys(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"content": d, "id": 1} for d in documents(5)])
    message = one_line("no record of .* has the text key 'text'", prepare_shards, [corpus], tmp_path / "o")
    assert "content, id" in message and "--text-key" in message
    parquet = write_parquet(tmp_path / "c.parquet", documents(5), key="body")
    one_line("has the text key 'text' .*body, id", prepare_shards, [parquet], tmp_path / "p")
    assert prepare_shards([parquet], tmp_path / "p", text_key="body").manifest["documents"] == 5


def test_bad_input_is_one_line_each(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}])
    (tmp_path / "c.csv").write_text("a,b\n")
    one_line(
        r"c.csv has an unknown extension; prepare reads \.txt, \.jsonl",
        prepare_shards,
        [tmp_path / "c.csv"],
        tmp_path / "o",
    )
    empty = tmp_path / "empty_model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    one_line("holds no tokenizer", prepare_shards, [corpus], tmp_path / "o", tokenizer=empty)
    one_line("cannot do in one pass", prepare_shards, [corpus], tmp_path / "o", tokenizer="bpe")
    no_eos = bpe_dir(tmp_path, eos="<pad>", config=False)
    one_line("no end-of-text token", prepare_shards, [corpus], tmp_path / "o", tokenizer=no_eos)
    one_line("no files match", prepare_shards, [str(tmp_path / "*.parquet")], tmp_path / "o")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    one_line("is not a prepared directory", prepare_shards, [corpus], tmp_path / "busy")


def test_cli_prepares_a_glob_into_shards_then_inspects_them(tmp_path, capsys):
    for i in range(3):
        write_jsonl(tmp_path / f"part-{i}.jsonl", [{"text": d} for d in documents(40, seed=i)])
    out = tmp_path / "shards"
    argv = ["prepare", str(tmp_path / "part-*.jsonl"), "-o", str(out), "--workers", "2", "--shard-tokens", "2000"]
    assert main([*argv, "--val-fraction", "0.1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "120 documents" not in printed and "108 documents" in printed and "12 documents" in printed
    assert main(["inspect", str(out), "--seq-len", "64"]) == 0
    assert "windows" in capsys.readouterr().out
    assert main([*argv, "--val-fraction", "0.1"]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert main([*argv, "--max-bytes", "10"]) == 2
    assert "--max-bytes applies to a .npy output only" in capsys.readouterr().err
