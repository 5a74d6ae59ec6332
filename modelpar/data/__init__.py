"""Training data: token files, tokenizers, the prepare step, the default corpus and the dp-aware sampler.

    modelpar.data.token_file  TokenFile: a validated memory-mapped .npy of ids, read as shifted windows
    modelpar.data.tokenizer   byte-level and BPE tokenizers (encode/decode)
    modelpar.data.prepare     text files -> token file + JSON sidecar, written atomically
    modelpar.data.records     documents of .txt / .jsonl(.gz/.zst) / .parquet files, streamed
    modelpar.data.prepare_shards  a corpus -> a shard directory (worker processes, manifest, resumable)
    modelpar.data.shards      shard directories and WindowSet: windows of several token files
    modelpar.data.blend       Blend and BlendSampler: several datasets sampled with weights
    modelpar.data.corpus      the default corpus: Python's stdlib source, built once into a cache folder
    modelpar.data.sampler     WindowSampler: seeded global order, contiguous dp slices, resumable

Typical use in a training loop::

    corpus = default_corpus("data/cache")
    data = TokenFile.open(corpus.path, vocab_size=256, seq_len=256)
    sampler = WindowSampler(data.num_windows, global_batch=32, dp_rank=r, dp_size=dp, seed=0)
    inputs, targets = data.batch(sampler.next_batch())      # [32 / dp, 256] each
"""

from modelpar.data.blend import Blend, BlendSampler, open_blend
from modelpar.data.corpus import default_corpus, stdlib_sources
from modelpar.data.prepare import PreparedInfo, prepare, tokenizer_for, tokenizer_spec
from modelpar.data.prepare_shards import prepare_shards
from modelpar.data.sampler import WindowSampler
from modelpar.data.shards import WindowSet, eval_split, held_out, open_dataset
from modelpar.data.token_file import DataError, TokenFile, max_token_id, open_tokens
from modelpar.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer",
    "Blend",
    "BlendSampler",
    "ByteTokenizer",
    "DataError",
    "PreparedInfo",
    "TokenFile",
    "Tokenizer",
    "WindowSampler",
    "WindowSet",
    "default_corpus",
    "eval_split",
    "held_out",
    "load_tokenizer",
    "max_token_id",
    "open_blend",
    "open_dataset",
    "open_tokens",
    "prepare",
    "prepare_shards",
    "stdlib_sources",
    "tokenizer_for",
    "tokenizer_spec",
    "train_bpe",
]
