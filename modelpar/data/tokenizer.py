"""Tokenizers: text <-> token ids.

Two kinds. ``byte`` needs nothing: ids are the UTF-8 bytes of the text (vocabulary 256), so any text on any
machine tokenises the same way. ``bpe`` is a Hugging Face ``tokenizers`` tokenizer: a byte-level BPE (GPT-2
style, lossless on any text) trained locally, a ``tokenizer.json``, or the tokenizer files of a Hugging Face
model directory, read locally. ``tokenizers`` is imported only when asked for, so the base install does not
need it.

Documents are separated by the tokenizer's end-of-text id (``eos_id``): byte 0 for ``byte``, the model's EOS
token (``tokenizer_config.json``) or a conventional name (``<|endoftext|>``, ``</s>``, ...) for ``bpe``.
"""

from __future__ import annotations

import hashlib
import json
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

# End-of-text tokens by their usual names (GPT-2/NeoX, Llama 2/Mistral, Llama 3, Gemma), tried in this order
# when a tokenizer does not say which token it ends documents with.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")

# A Hugging Face model directory names its tokenizer with these files (``AutoTokenizer`` reads them).
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


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

    @abstractmethod
    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text (no special tokens added), ``[n_i]`` each, as one batch call."""

    @property
    @abstractmethod
    def eos_id(self) -> int | None:
        """The id that ends a document, or None if the tokenizer has none."""

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """What identifies the tokenizer: equal fingerprints give equal ids for equal text."""


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

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    @property
    def eos_id(self) -> int:
        return 0  # NUL: a byte that text files do not contain

    @property
    def fingerprint(self) -> str:
        return "byte"

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
    eos_token: str | None = None  # the token that ends a document, when the tokenizer's files name it

    @classmethod
    def load(cls, path: str | Path, eos_token: str | None = None) -> BPETokenizer:
        """Read a ``tokenizer.json``."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist; train one with --tokenizer bpe")
        tokenizers = _import_tokenizers()
        try:
            return cls(backend=tokenizers.Tokenizer.from_file(str(path)), eos_token=eos_token)
        except Exception as e:  # noqa: BLE001 -- the Rust side raises plain Exception for a malformed file
            raise DataError(f"{path} is not a tokenizers tokenizer.json ({' '.join(str(e).split())})") from None

    @classmethod
    def from_model_dir(cls, path: str | Path) -> BPETokenizer:
        """The tokenizer of a Hugging Face model directory, read locally: its ``tokenizer.json`` (with the EOS
        token of ``tokenizer_config.json``), else whatever ``transformers.AutoTokenizer`` builds from its files."""
        path = Path(path)
        config = path / "tokenizer_config.json"
        eos = _eos_of_config(config) if config.is_file() else None
        if (path / "tokenizer.json").is_file():
            return cls.load(path / "tokenizer.json", eos_token=eos)
        if not any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
            raise DataError(
                f"{path} holds no tokenizer ({', '.join(_HF_TOKENIZER_FILES)}); pass a Hugging Face model "
                "directory with its tokenizer files, a tokenizer.json, or --tokenizer byte"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(
                f"{path} has no tokenizer.json; reading its other tokenizer files needs `pip install transformers`"
            ) from None
        try:
            auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read the tokenizer in {path} ({' '.join(str(e).split())[:200]})") from None
        if not getattr(auto, "is_fast", False):
            raise DataError(f"{path} gives a slow (Python) tokenizer; save it as tokenizer.json with a fast one")
        return cls(backend=auto.backend_tokenizer, eos_token=eos or auto.eos_token)

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        # the same ids as encode_batch, without computing character offsets (tokenizers >= 0.20)
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [np.asarray(e.ids, dtype=np.int64) for e in encode(list(texts), add_special_tokens=False)]

    @property
    def eos_id(self) -> int | None:
        for name in (self.eos_token, *EOS_NAMES) if self.eos_token else EOS_NAMES:
            found = self.backend.token_to_id(name)
            if found is not None:
                return found
        return None

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.backend.to_str().encode())
        digest.update(f"eos={self.eos_id}".encode())
        return f"bpe-{digest.hexdigest()[:32]}"

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

    The 256 byte symbols are always in the vocabulary, so any text encodes without unknown tokens; the
    end-of-text token ``<|endoftext|>`` is its first id (a special token, as GPT-2's: only that literal string
    in a text encodes to it).
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
        special_tokens=[EOS_NAMES[0]],  # the end-of-text id that separates documents in a shard directory
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(backend=backend, eos_token=EOS_NAMES[0])


def _eos_of_config(path: Path) -> str | None:
    """The ``eos_token`` named by a ``tokenizer_config.json`` (a string, or ``{"content": ...}``)."""
    try:
        eos = json.loads(path.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"byte"``, the path of a ``tokenizer.json``, or a Hugging Face model directory."""
    if str(spec) == ByteTokenizer.kind:
        return ByteTokenizer()
    if Path(spec).is_dir():
        return BPETokenizer.from_model_dir(spec)
    if not Path(spec).is_file():
        raise DataError(
            f"tokenizer {str(spec)!r} is not 'byte' or an existing tokenizer.json file or model directory; "
            "use --tokenizer byte, bpe (to train one), a tokenizer.json or a Hugging Face model directory"
        )
    return BPETokenizer.load(spec)
