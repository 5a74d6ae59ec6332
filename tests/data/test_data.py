"""Data pipeline: token files, tokenizers, the prepare step, the default corpus, the sampler and the CLI."""

import hashlib
import json
import sys

import numpy as np
import pytest
import torch

from modelpar.cli.data import main
from modelpar.data import (
    ByteTokenizer,
    DataError,
    PreparedInfo,
    TokenFile,
    WindowSampler,
    default_corpus,
    prepare,
    stdlib_sources,
    tokenizer_for,
)
from modelpar.data import token_file as token_file_module

TEXT = "def f(x):\n    return x * 2  # ünïcödé ✓ 日本\n\nclass A:\n    pass\n" * 40


def save(path, array, **kwargs):
    np.save(path, array, **kwargs)
    return path


def raises_one_line(match, fn, *args, **kwargs):
    with pytest.raises(DataError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


# --- token files ---------------------------------------------------------------------------------------------


def test_window_targets_are_inputs_shifted_by_one(tmp_path):
    tokens = np.arange(23, dtype=np.uint16)
    data = TokenFile.open(save(tmp_path / "t.npy", tokens), vocab_size=23, seq_len=5)
    inputs, targets = data.window(2)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.tolist() == [10, 11, 12, 13, 14]
    assert targets.tolist() == [11, 12, 13, 14, 15]


def test_num_windows_drops_the_incomplete_tail(tmp_path):
    data = TokenFile.open(save(tmp_path / "t.npy", np.arange(23, dtype=np.uint32)), vocab_size=23, seq_len=5)
    assert data.num_windows == 4  # windows end at tokens 5, 10, 15, 20; 21..22 cannot fill a fifth
    assert data.window(3)[1].tolist() == [16, 17, 18, 19, 20]


def test_batch_stacks_the_requested_windows(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=101, dtype=np.uint16)
    data = TokenFile.open(save(tmp_path / "t.npy", tokens), vocab_size=300, seq_len=7)
    indices = [13, 0, 5, 5]
    inputs, targets = data.batch(np.array(indices))
    assert inputs.shape == targets.shape == (4, 7)
    for row, i in enumerate(indices):
        assert torch.equal(inputs[row], data.window(i)[0])
        assert torch.equal(targets[row], data.window(i)[1])


def test_batch_rejects_a_window_past_the_end(tmp_path):
    data = TokenFile.open(save(tmp_path / "t.npy", np.arange(23, dtype=np.uint16)), vocab_size=23, seq_len=5)
    with pytest.raises(IndexError, match="window 4 is outside 0..3"):
        data.batch([1, 4])


@pytest.mark.parametrize(
    "array, match",
    [
        (np.arange(10, dtype=np.float32), "dtype float32; token ids must be uint16 or uint32"),
        (np.arange(10, dtype=np.int64), "dtype int64; token ids must be uint16 or uint32"),
        (np.arange(12, dtype=np.uint16).reshape(3, 4), r"shape \(3, 4\); a token file is a 1-D stream"),
        (np.array([1, "two", None], dtype=object), "Python objects .* refused"),
        (np.array([3, 255, 256, 7] * 3, dtype=np.uint16), "contains token id 256 but vocab_size is 256"),
        (np.arange(8, dtype=np.uint16), "has 8 tokens but one window of seq_len=8 needs 9"),
    ],
    ids=["float32", "int64", "2-D", "pickled-objects", "id-over-vocab", "too-short"],
)
def test_unusable_token_file_is_one_line_naming_the_problem(tmp_path, array, match):
    path = save(tmp_path / "bad.npy", array, allow_pickle=True)
    raises_one_line(match, TokenFile.open, path, vocab_size=256, seq_len=8)


def test_missing_token_file_says_how_to_create_one(tmp_path):
    raises_one_line("does not exist; create it with .*prepare", TokenFile.open, tmp_path / "no.npy", 256, 8)


def test_text_file_is_not_a_npy(tmp_path):
    path = tmp_path / "corpus.npy"
    path.write_text("just some text, not an array\n" * 5)
    raises_one_line("is not a readable .npy file", TokenFile.open, path, 256, 8)


def test_vocab_check_scans_every_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(token_file_module, "_SCAN_CHUNK", 16)
    tokens = np.zeros(100, dtype=np.uint32)
    tokens[-1] = 70_000
    path = save(tmp_path / "t.npy", tokens)
    raises_one_line("id 70000 but vocab_size is 65536; .* at least 70001", TokenFile.open, path, 65536, 8)


# --- tokenizers ----------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int64 and ids.max() < tok.vocab_size == 256
    assert tok.decode(ids) == TEXT
    assert tok.decode(torch.from_numpy(ids)) == TEXT


def test_byte_decode_replaces_broken_utf8_and_unknown_ids():
    tok = ByteTokenizer()
    cut = list("é".encode())[:1]  # a sample that stops mid-character
    assert tok.decode([104, 105, *cut]) == "hi\ufffd"
    assert tok.decode([104, 300, 105]) == "h\ufffdi"


def test_bpe_trains_and_round_trips(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "a.txt").write_text(TEXT)
    info = prepare([tmp_path / "a.txt"], tmp_path / "out.npy", tokenizer="bpe", vocab_size=300)
    assert info.tokenizer == "bpe" and 256 < info.vocab_size <= 300
    assert info.tokenizer_path.is_file()
    tokens = np.load(info.path)
    assert len(tokens) < len(TEXT.encode()) / 2  # merges learned on repetitive text compress it
    tok = tokenizer_for(info.path)
    assert tok.decode(tokens) == TEXT
    assert tok.decode(tok.encode("unseen ✓ text")) == "unseen ✓ text"


# --- prepare -------------------------------------------------------------------------------------------------


def test_prepare_byte_writes_the_utf8_bytes_and_a_sidecar(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    info = prepare([tmp_path / "a.txt"], tmp_path / "out" / "corpus.npy")
    tokens = np.load(info.path, allow_pickle=False)
    assert tokens.dtype == np.uint16
    assert tokens.tobytes() == np.frombuffer(TEXT.encode(), np.uint8).astype(np.uint16).tobytes()
    assert PreparedInfo.read(info.path) == info
    sidecar = json.loads((tmp_path / "out" / "corpus.json").read_text())
    assert sidecar["n_tokens"] == len(TEXT.encode()) and sidecar["tokenizer"] == "byte"
    assert sidecar["sha256"] == hashlib.sha256(info.path.read_bytes()).hexdigest()
    assert sidecar["sources"] == [str(tmp_path / "a.txt")]


def test_prepare_refuses_to_overwrite(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "corpus.npy"
    prepare([tmp_path / "a.txt"], out)
    raises_one_line("refusing to overwrite .*corpus.npy; pass --overwrite", prepare, [tmp_path], out)
    (tmp_path / "a.txt").write_text("new text\n")
    assert prepare([tmp_path / "a.txt"], out, overwrite=True).n_tokens == len("new text\n")


def test_prepare_splits_the_last_tokens_into_a_val_file(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    info = prepare([tmp_path / "a.txt"], tmp_path / "corpus.npy", val_fraction=0.1)
    assert info.val_path == tmp_path / "corpus-val.npy"
    train, val = np.load(info.path), np.load(info.val_path)
    assert len(val) == round(len(TEXT.encode()) * 0.1)
    assert np.concatenate([train, val]).astype(np.uint8).tobytes() == TEXT.encode()
    assert PreparedInfo.read(info.val_path).n_tokens == len(val)


def test_prepare_reads_directories_in_sorted_order_and_caps_at_whole_lines(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "b.txt").write_text("bbb\nbbb\n")
    (tmp_path / "docs" / "sub" / "a.txt").write_text("sub\n")
    (tmp_path / "docs" / "a.txt").write_text("aaa\n")
    (tmp_path / "docs" / "skip.md").write_text("not matched\n")
    info = prepare([tmp_path / "docs"], tmp_path / "all.npy")
    assert np.load(info.path).astype(np.uint8).tobytes() == b"aaa\nbbb\nbbb\nsub\n"
    capped = prepare([tmp_path / "docs"], tmp_path / "capped.npy", max_bytes=10)
    assert np.load(capped.path).astype(np.uint8).tobytes() == b"aaa\nbbb\n"
    assert len(capped.sources) == 2


def test_prepare_names_missing_inputs_and_empty_globs(tmp_path):
    raises_one_line("input .*nothing does not exist", prepare, [tmp_path / "nothing"], tmp_path / "o.npy")
    raises_one_line(r"no files match '\*.txt'", prepare, [tmp_path], tmp_path / "o.npy")


def test_byte_tokenizer_has_a_fixed_vocabulary(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    raises_one_line("vocab_size=512 .* byte tokenizer has 256", prepare, [tmp_path], tmp_path / "o.npy", vocab_size=512)


def test_unknown_tokenizer_names_the_choices(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    raises_one_line("'bytes' is not 'byte' or .* bpe", prepare, [tmp_path], tmp_path / "o.npy", tokenizer="bytes")


# --- default corpus ------------------------------------------------------------------------------------------


def test_stdlib_sources_skip_tests_and_installed_packages():
    sources = stdlib_sources()
    assert sources == sorted(sources)
    assert any(p.name == "argparse.py" for p in sources)
    assert not any({"test", "tests", "site-packages"} & set(p.parts) for p in sources)


def test_default_corpus_builds_once_then_is_reused(tmp_path, monkeypatch):
    info = default_corpus(tmp_path, max_bytes=200_000)
    assert info.path.parent == tmp_path and info.path.name.startswith("stdlib-byte-")
    assert 190_000 < info.n_tokens + PreparedInfo.read(info.val_path).n_tokens <= 200_000
    train = TokenFile.open(info.path, vocab_size=256, seq_len=64)
    val = TokenFile.open(info.val_path, vocab_size=256, seq_len=64)
    assert train.num_windows > 10 * val.num_windows > 0
    assert ByteTokenizer().decode(train.tokens[:100]).startswith('"""')

    def fail(*args, **kwargs):
        raise AssertionError("the cached corpus was rebuilt")

    monkeypatch.setattr("modelpar.data.corpus.prepare", fail)
    assert default_corpus(tmp_path, max_bytes=200_000) == info


# --- sampler -------------------------------------------------------------------------------------------------


def take(sampler, steps):
    return [sampler.next_batch().tolist() for _ in range(steps)]


def test_sampler_is_deterministic_and_seeded():
    assert take(WindowSampler(50, 6, seed=3), 20) == take(WindowSampler(50, 6, seed=3), 20)
    assert take(WindowSampler(50, 6, seed=3), 8) != take(WindowSampler(50, 6, seed=4), 8)


def test_epoch_visits_distinct_windows_and_drops_the_incomplete_batch():
    sampler = WindowSampler(50, 6, seed=1)
    epoch = take(sampler, sampler.steps_per_epoch)
    seen = [i for batch in epoch for i in batch]
    assert sampler.steps_per_epoch == 8 and len(set(seen)) == 48 and set(seen) <= set(range(50))
    assert sampler.next_batch().tolist() != epoch[0] and sampler.epoch == 1


def test_unshuffled_sampler_walks_the_file_in_order():
    sampler = WindowSampler(10, 4, dp_rank=1, dp_size=2, shuffle=False)
    assert take(sampler, 3) == [[2, 3], [6, 7], [2, 3]]


@pytest.mark.parametrize("dp_size", [2, 3])
def test_dp_shards_are_disjoint_and_concatenate_to_the_dp1_batch(dp_size):
    reference = WindowSampler(61, 6, seed=7)
    shards = [WindowSampler(61, 6, dp_rank=r, dp_size=dp_size, seed=7) for r in range(dp_size)]
    for _ in range(25):  # crosses two epoch boundaries (10 steps per epoch)
        parts = [s.next_batch() for s in shards]
        assert all(len(p) == 6 // dp_size for p in parts)
        assert np.concatenate(parts).tolist() == reference.next_batch().tolist()


@pytest.mark.parametrize("stop_after", [3, 9, 10])
def test_resume_continues_exactly_across_the_epoch_boundary(stop_after):
    uninterrupted = WindowSampler(41, 4, seed=5)
    take(uninterrupted, stop_after)
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    resumed = WindowSampler(41, 4, seed=5)
    resumed.load_state_dict(state)
    assert take(resumed, 15) == take(uninterrupted, 15)


def test_resume_with_a_different_dp_keeps_the_global_order():
    saved = WindowSampler(41, 4, seed=5)
    take(saved, 7)
    state = saved.state_dict()
    shards = [WindowSampler(41, 4, dp_rank=r, dp_size=2) for r in range(2)]
    for shard in shards:
        shard.load_state_dict(state)
    for _ in range(6):
        assert np.concatenate([s.next_batch() for s in shards]).tolist() == saved.next_batch().tolist()


def test_resume_refuses_a_different_global_batch():
    state = WindowSampler(41, 4).state_dict()
    raises_one_line("saved sampler has global_batch=4 but this run has 8", WindowSampler(41, 8).load_state_dict, state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_windows": 5, "global_batch": 8}, "global_batch=8 windows exceeds the 5 windows in the data"),
        ({"num_windows": 50, "global_batch": 10, "dp_size": 4}, "not divisible by dp=4; try 8 or 12"),
        ({"num_windows": 50, "global_batch": 8, "dp_rank": 2, "dp_size": 2}, r"dp_rank=2 must be in 0..1"),
    ],
    ids=["batch-over-data", "indivisible", "bad-rank"],
)
def test_sampler_rejects_impossible_settings(kwargs, match):
    raises_one_line(match, WindowSampler, **kwargs)


# --- CLI -----------------------------------------------------------------------------------------------------


def test_cli_prepares_and_inspects(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    assert main(["prepare", str(tmp_path / "a.txt"), "--output", str(tmp_path / "c.npy")]) == 0
    assert main(["inspect", str(tmp_path / "c.npy"), "--seq-len", "100", "--vocab-size", "256"]) == 0
    out = capsys.readouterr().out
    assert "dtype      uint16" in out
    assert f"windows    {(len(TEXT.encode()) - 1) // 100} of seq_len 100" in out
    assert "tokenizer  byte, vocab 256" in out


def test_cli_error_is_one_stderr_line_with_status_2(tmp_path, capsys):
    save(tmp_path / "f.npy", np.zeros(10, dtype=np.float32))
    assert main(["inspect", str(tmp_path / "f.npy")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("modelpar-data: error:") and "float32" in err


def test_consecutive_windows_share_one_token_as_the_docstrings_say(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(40, dtype=np.uint16))
    data = TokenFile.open(path, vocab_size=256, seq_len=8)
    (x0, y0), (x1, _) = (tuple(t[0] for t in data.batch([i])) for i in (0, 1))
    assert int(y0[-1]) == int(x1[0]) == 8  # window 1 starts at token 8, the last target of window 0
    for doc in (TokenFile.__doc__, sys.modules[TokenFile.__module__].__doc__):
        assert "share one" in doc and "non-overlapping" not in doc
