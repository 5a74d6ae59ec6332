"""Training data: token files, tokenizers, the prepare step, the default corpus and the dp-aware sampler.

    modelpar.data.token_file  TokenFile: a validated memory-mapped .npy of ids, read as shifted windows
    modelpar.data.tokenizer   byte-level and BPE tokenizers (encode/decode)
    modelpar.data.prepare     text files -> token file + JSON sidecar, written atomically
    modelpar.data.corpus      the default corpus: Python's stdlib source, built once into a cache folder
    modelpar.data.sampler     WindowSampler: seeded global order, contiguous dp slices, resumable

Typical use in a training loop::

    corpus = default_corpus("data/cache")
    data = TokenFile.open(corpus.path, vocab_size=256, seq_len=256)
    sampler = WindowSampler(data.num_windows, global_batch=32, dp_rank=r, dp_size=dp, seed=0)
    inputs, targets = data.batch(sampler.next_batch())      # [32 / dp, 256] each
"""

from modelpar.data.corpus import default_corpus, stdlib_sources
from modelpar.data.prepare import PreparedInfo, prepare, tokenizer_for
from modelpar.data.sampler import WindowSampler
from modelpar.data.token_file import DataError, TokenFile, max_token_id, open_tokens
from modelpar.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "DataError",
    "PreparedInfo",
    "TokenFile",
    "Tokenizer",
    "WindowSampler",
    "default_corpus",
    "load_tokenizer",
    "max_token_id",
    "open_tokens",
    "prepare",
    "stdlib_sources",
    "tokenizer_for",
    "train_bpe",
]
