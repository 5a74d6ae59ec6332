"""Tokenising in worker processes for a prepare: each worker builds its tokenizer once, then turns batches of
``(text, ends_document, held_out)`` into the ids and document ends of the train and held-out splits;
``tokenizer_pool(0, ...)`` runs the same code in this process."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np

from modelpar.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

_worker_tokenizer: Tokenizer | None = None
_worker_dtype: np.dtype | None = None


def _init_worker(spec: str | None, eos_token: str | None, dtype: str) -> None:
    """Build this process's tokenizer once (a byte tokenizer, or a ``tokenizer.json`` given as text)."""
    global _worker_tokenizer, _worker_dtype
    # one thread per worker: the pool is the parallelism, and tokenizers' own threads would oversubscribe
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if spec is None:
        _worker_tokenizer = ByteTokenizer()
    else:
        import tokenizers

        _worker_tokenizer = BPETokenizer(backend=tokenizers.Tokenizer.from_str(spec), eos_token=eos_token)
    _worker_dtype = np.dtype(dtype)


def tokenize_batch(batch: list[tuple[str, bool, bool]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(text, ends_document, held_out)`` items -> ids and document ends of the train and held-out splits."""
    tok = _worker_tokenizer
    eos = np.array([tok.eos_id], dtype=_worker_dtype)
    encoded = tok.encode_documents([text for text, _, _ in batch])
    out = []
    for split in (False, True):
        pieces, ends, length = [], [], 0
        for ids, (_, ends_document, held) in zip(encoded, batch, strict=True):
            if held is not split:
                continue
            pieces.append(ids.astype(_worker_dtype, copy=False))
            length += len(ids)
            if ends_document:
                pieces.append(eos)
                length += 1
                ends.append(length)
        out.append(np.concatenate(pieces) if pieces else np.empty(0, dtype=_worker_dtype))
        out.append(np.asarray(ends, dtype=np.int64))
    return out[0], out[1], out[2], out[3]


class _InProcess:
    """``workers=0``: tokenise in this process with the same code the workers run."""

    class _Done:
        def __init__(self, value):
            self.value = value

        def get(self):
            return self.value

    def apply_async(self, fn, args):
        return self._Done(fn(*args))

    def terminate(self) -> None:
        pass

    def join(self) -> None:
        pass


def tokenizer_pool(workers: int, tokenizer: Tokenizer, dtype: np.dtype):
    spec = tokenizer.backend.to_str() if isinstance(tokenizer, BPETokenizer) else None
    eos = tokenizer.eos_token if isinstance(tokenizer, BPETokenizer) else None
    if workers == 0:
        _init_worker(spec, eos, dtype.name)
        return _InProcess()
    # fork: a worker starts in milliseconds with the tokenizer's module loaded (no tokenizer threads ran yet)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(workers, _init_worker, (spec, eos, dtype.name))
