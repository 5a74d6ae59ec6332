"""The sample a run ends with: a continuation of held-out text from its first whole line, drawn at temperature 1
from the 40 likeliest tokens with a fixed seed, printed apart from its prompt. Greedy or cooled sampling from a
small byte-level model collapses into the commonest byte of source code, the space."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modelpar.cli.generate import Sample, generate, held_out_prompt, sample_from_checkpoint
from modelpar.data import ByteTokenizer, default_corpus
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_model
from tests.helpers import save_whole_model_checkpoint

TOK = ByteTokenizer()
# the default recipe's model, smaller, trained briefly on standard-library source (its loss ends near 2.4)
MODEL = ModelConfig(vocab_size=256, hidden=48, layers=2, heads=4, kv_heads=2, ffn_hidden=96, max_seq_len=128,
                    tie_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of MODEL after 150 AdamW steps on the standard-library corpus, and that corpus's held-out file."""
    tmp = tmp_path_factory.mktemp("sample")
    corpus = default_corpus(tmp / "cache", max_bytes=300_000)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: more threads only contend with the other test processes
    try:
        return _train(tmp, corpus)
    finally:
        torch.set_num_threads(threads)


def _train(tmp, corpus):
    tokens = np.load(corpus.path, mmap_mode="r")
    torch.manual_seed(0)
    model = build_model(MODEL, seed=0)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(0)
    for _ in range(150):
        starts = rng.integers(0, len(tokens) - 65, size=16)
        batch = torch.as_tensor(np.stack([tokens[s : s + 65] for s in starts]).astype(np.int64))
        logits = model(batch[:, :-1])[..., : MODEL.vocab_size]
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        adam.zero_grad()
        loss.backward()
        adam.step()
    return save_whole_model_checkpoint(tmp / "ckpt", MODEL, model=model.eval()), corpus.val_path, loss.item()


def test_a_trained_models_sample_continues_held_out_text_with_more_than_whitespace(trained):
    ckpt, val_path, loss = trained
    assert loss < 3.0  # it learned something of the corpus
    sample = sample_from_checkpoint(ckpt, val_path, 64, seq_len=64)
    held_out = TOK.decode(np.load(val_path)[:64].tolist())
    assert sample.prompt and sample.prompt in held_out and sample.prompt == sample.prompt.rstrip()
    text = sample.continuation
    assert len(TOK.encode(text)) == 64
    assert text.strip(), f"the continuation is only whitespace: {text!r}"
    assert len(set(text.strip())) > 3, f"the continuation repeats one character: {text!r}"
    again = sample_from_checkpoint(ckpt, val_path, 64, seq_len=64)
    assert again == sample  # a fixed seed: the same sample every run


def test_the_prompt_starts_at_a_whole_line_and_ends_on_text():
    window = torch.as_tensor(TOK.encode('   assert keysym == "Next"\n        newsel = min(len(self.c    '))
    prompt = TOK.decode(held_out_prompt(window, TOK, 48).tolist())
    assert prompt == "        newsel = min(len(self.c"
    assert TOK.decode(held_out_prompt(window, TOK, 12).tolist()) == "        news"
    one_line = torch.as_tensor(TOK.encode("no line break"))
    assert TOK.decode(held_out_prompt(one_line, TOK, 48).tolist()) == "no line break"
    last_line_blank = torch.as_tensor(TOK.encode("derived from that of the left-hand\n   "))
    assert TOK.decode(held_out_prompt(last_line_blank, TOK, 48).tolist()) == "derived from that of the left-hand"


def test_top_1_sampling_is_greedy():
    model = build_model(replace(MODEL, layers=1), seed=0).eval()
    prompt = torch.as_tensor(TOK.encode("def main("))
    assert torch.equal(generate(model, prompt, 12, temperature=1.0, seed=3, top_k=1), generate(model, prompt, 12))


def test_the_sample_prints_prompt_and_continuation_apart_and_names_a_whitespace_one():
    lines = Sample("def f(x):", "\n    return x", 12, 1.0, 40, 0).lines()
    assert lines[0].endswith("(12 tokens, temperature 1, top-k 40, seed 0), continuing held-out text")
    assert lines[1:] == ["--- prompt ---", "def f(x):", "--- continuation ---", "\n    return x"]
    assert Sample("x", " \n  ", 4, 1.0, 40, 0).lines()[-1] == "(only whitespace: ' \\n  ')"
