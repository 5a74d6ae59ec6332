"""Tokenizers: text <-> token ids.

Two kinds. ``byte`` needs nothing: ids are the UTF-8 bytes of the text (vocabulary 256), so any text on any
machine tokenises the same way. ``bpe`` is a byte-level BPE (GPT-2 style, lossless on any text) trained
locally with the Hugging Face ``tokenizers`` package, imported only when asked for so the base install does
not need it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from modelpar.data.token_file import DataError

BYTE_VOCAB_SIZE = 256

# The BPE tokenizer encodes a document in pieces of about this many characters (cut after a newline) so
# that ``encode_batch`` can spread one large file over the tokenizer's threads.
_BPE_PIECE_CHARS = 1 << 16


class Tokenizer(ABC):
    """Text <-> token ids. ``kind`` names the family ("byte" or "bpe")."""

    kind: ClassVar[str]

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; every id produced by :meth:`encode` is below it."""

    @abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as ``ids: [n]`` int64."""

    @abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids: [n]``; ids the tokenizer does not know decode to U+FFFD instead of raising."""


def _as_id_array(ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class ByteTokenizer(Tokenizer):
    """Ids are the UTF-8 bytes of the text. Decoding replaces broken UTF-8 (e.g. a sample cut mid-character)."""

    kind: ClassVar[str] = "byte"

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        ids = _as_id_array(ids)
        # A model whose embedding is padded past 256 rows can sample ids that are not bytes.
        pieces, start = [], 0
        for stop in np.flatnonzero((ids < 0) | (ids >= BYTE_VOCAB_SIZE)):
            pieces.append(_utf8(ids[start:stop]))
            start = stop + 1
        pieces.append(_utf8(ids[start:]))
        return "\ufffd".join(pieces)


def _utf8(byte_ids: np.ndarray) -> str:
    return byte_ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "the bpe tokenizer needs the `tokenizers` package; install it with `pip install tokenizers` "
            "or use --tokenizer byte"
        ) from None
    return tokenizers


@dataclass(frozen=True, eq=False)
class BPETokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer, normally a byte-level BPE from :func:`train_bpe`."""

    kind: ClassVar[str] = "bpe"
    backend: Any

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Read a ``tokenizer.json``."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist; train one with --tokenizer bpe")
        tokenizers = _import_tokenizers()
        try:
            return cls(backend=tokenizers.Tokenizer.from_file(str(path)))
        except Exception as e:  # noqa: BLE001 -- the Rust side raises plain Exception for a malformed file
            raise DataError(f"{path} is not a tokenizers tokenizer.json ({' '.join(str(e).split())})") from None

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        encodings = self.backend.encode_batch(list(_pieces(text, _BPE_PIECE_CHARS)))
        return np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        ids = _as_id_array(ids)
        known = (ids >= 0) & (ids < self.vocab_size)
        pieces, start = [], 0
        for stop in np.flatnonzero(~known):
            pieces.append(self.backend.decode(ids[start:stop].tolist()))
            start = stop + 1
        pieces.append(self.backend.decode(ids[start:].tolist()))
        return "\ufffd".join(pieces)


def _pieces(text: str, size: int) -> Iterable[str]:
    """``text`` in consecutive pieces of about ``size`` characters, each ending after a newline if it can."""
    start = 0
    while start < len(text):
        stop = text.find("\n", start + size)
        stop = len(text) if stop == -1 else stop + 1
        yield text[start:stop]
        start = stop


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` ids on ``texts`` (fewer if the text runs out of merges).

    The 256 byte symbols are always in the vocabulary, so any text encodes without unknown tokens.
    """
    if vocab_size <= BYTE_VOCAB_SIZE:
        raise DataError(f"bpe vocab_size={vocab_size} must exceed the {BYTE_VOCAB_SIZE} byte symbols it starts from")
    tokenizers = _import_tokenizers()
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(backend=backend)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"byte"`` or the path of a ``tokenizer.json``."""
    if str(spec) == ByteTokenizer.kind:
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise DataError(
            f"tokenizer {str(spec)!r} is not 'byte' or an existing tokenizer.json file; "
            "use --tokenizer byte, bpe (to train one) or the path of a tokenizer.json"
        )
    return BPETokenizer.load(spec)
