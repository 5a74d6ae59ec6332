"""Prepare: tokenise text files into a token file (``OUT.npy``) with a JSON sidecar (``OUT.json``).

Files written for ``prepare([...], "corpus.npy", tokenizer="bpe", val_fraction=0.05)``::

    corpus.npy              uint16/uint32 ids, the first 95% of the tokens
    corpus.json             sidecar: tokenizer, vocab_size, n_tokens, dtype, sha256, sources, val_file
    corpus-val.npy          the last 5%, held out for evaluation
    corpus-val.json         its sidecar
    corpus.tokenizer.json   the trained BPE (bpe only), shared by both splits

Tokens are streamed to disk, so memory stays bounded whatever the corpus size, and every file appears
atomically (written to a temporary name, then ``os.replace``): a reader never sees half a corpus.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from modelpar.data.records import FORMATS, SourceReader, suffix_of
from modelpar.data.shards import tokenizer_file_of
from modelpar.data.token_file import DataError
from modelpar.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

DEFAULT_BPE_VOCAB_SIZE = 8192
SIDECAR_FORMAT = 1

# Text is read in blocks of whole lines: big enough to amortise per-call costs, small enough that a
# multi-gigabyte single-file corpus never has to fit in memory.
_BLOCK_BYTES = 1 << 20
_COPY_BLOCK_IDS = 1 << 22


@dataclass(frozen=True)
class PreparedInfo:
    """What the sidecar of one token file records. ``val_path`` is the held-out split written with it."""

    path: Path
    tokenizer: str
    vocab_size: int
    n_tokens: int
    dtype: str
    sha256: str
    sources: tuple[str, ...] = field(repr=False)
    tokenizer_path: Path | None = None
    val_path: Path | None = None

    @staticmethod
    def sidecar_path(path: str | Path) -> Path:
        return Path(path).with_suffix(".json")

    @classmethod
    def read(cls, path: str | Path) -> PreparedInfo:
        """The sidecar of token file ``path``."""
        path = Path(path)
        sidecar = cls.sidecar_path(path)
        try:
            record = json.loads(sidecar.read_text())
            return cls(
                path=path,
                tokenizer=record["tokenizer"],
                vocab_size=record["vocab_size"],
                n_tokens=record["n_tokens"],
                dtype=record["dtype"],
                sha256=record["sha256"],
                sources=tuple(record["sources"]),
                tokenizer_path=path.parent / record["tokenizer_file"] if record["tokenizer_file"] else None,
                val_path=path.parent / record["val_file"] if record["val_file"] else None,
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"cannot read the sidecar {sidecar} of {path} ({type(e).__name__}: {e}); "
                "rebuild it with `modelpar-data prepare ... --overwrite`"
            ) from None

    def to_json(self) -> dict:
        """The sidecar record; file references are names relative to the token file's folder."""
        return {
            "format": SIDECAR_FORMAT,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "n_tokens": self.n_tokens,
            "dtype": self.dtype,
            "sha256": self.sha256,
            "tokenizer_file": self.tokenizer_path.name if self.tokenizer_path else None,
            "val_file": self.val_path.name if self.val_path else None,
            "sources": list(self.sources),
        }


def tokenizer_for(path: str | Path) -> Tokenizer:
    """The tokenizer that produced token file ``path`` (its sidecar) or shard directory ``path`` (its manifest),
    e.g. to decode samples."""
    if Path(path).is_dir():
        return load_tokenizer(tokenizer_file_of(path) or "byte")
    info = PreparedInfo.read(path)
    return load_tokenizer(info.tokenizer_path or info.tokenizer)


def tokenizer_spec(path) -> str | None:
    """What ``load_tokenizer`` takes to decode data ``path`` (a token file, shard directory or blend: its first
    dataset's), as a checkpoint records it: ``"byte"``, a tokenizer file's absolute path, or None when a plain
    token file records no tokenizer."""
    path = Path(getattr(path, "paths", [path])[0])
    if path.is_dir():
        file = tokenizer_file_of(path)
        return str(file) if file else ByteTokenizer.kind
    try:
        info = PreparedInfo.read(path)
    except DataError:
        return None
    return str(Path(info.tokenizer_path).resolve()) if info.tokenizer_path else info.tokenizer


def val_path_for(output: str | Path) -> Path:
    """``corpus.npy`` -> ``corpus-val.npy``."""
    output = Path(output)
    return output.with_name(f"{output.stem}-val{output.suffix}")


def collect_sources(inputs: Sequence[str | Path], glob: str) -> list[Path]:
    """Files among ``inputs`` plus those matching ``glob`` under directory inputs, in a deterministic order.

    Input order is kept; each directory's matches are sorted by path; a file named twice is read once.
    """
    sources: dict[Path, None] = {}
    for item in map(Path, inputs):
        if item.is_file():
            sources[item] = None
        elif item.is_dir():
            sources.update(dict.fromkeys(sorted(p for p in item.rglob(glob) if p.is_file())))
        else:
            raise DataError(f"input {item} does not exist; pass text files or directories")
    if not sources:
        raise DataError(f"no files match {glob!r} under {', '.join(map(str, inputs))}; pass files or another --glob")
    return list(sources)


def read_text_blocks(
    sources: Sequence[Path], max_bytes: int | None, text_key: str = "text"
) -> Iterator[tuple[Path, str]]:
    """``(source, text)`` blocks of whole lines, stopping before the line that would exceed ``max_bytes``.

    Invalid UTF-8 is replaced (U+FFFD) so every tokenizer sees the same text. A record file (``.jsonl``,
    ``.jsonl.gz``, ``.jsonl.zst``, ``.parquet``) gives each record's ``text_key`` field, not its raw lines; records
    without one are passed over (a shard directory output counts them).
    """
    budget = math.inf if max_bytes is None else max_bytes
    for path in sources:
        if FORMATS.get(suffix_of(path), "text") != "text":
            for unit in SourceReader(path, text_key).units():
                if unit.text is None:
                    continue
                size = len(unit.text.encode("utf-8", errors="replace"))
                if size > budget:
                    return
                budget -= size
                yield path, unit.text
            continue
        with path.open("rb") as f:
            pending = b""
            while True:
                chunk = f.read(_BLOCK_BYTES)
                data = pending + chunk
                # Cutting after a newline never splits a UTF-8 character; at end of file take the rest.
                cut = data.rfind(b"\n") + 1 if chunk else len(data)
                if cut > budget:
                    cut = data.rfind(b"\n", 0, int(budget)) + 1
                    if cut:
                        yield path, data[:cut].decode("utf-8", errors="replace")
                    return
                if cut:
                    yield path, data[:cut].decode("utf-8", errors="replace")
                budget -= cut
                pending = data[cut:]
                if not chunk:
                    break


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class _NpyStream:
    """A 1-D ``.npy`` written by appending, under a temporary name beside ``dest`` until :meth:`commit`.

    numpy pads the header so the length field can grow in place (the same bytes for shape ``(0,)`` and
    ``(10**19,)``), so the header is written first and rewritten once the length is known.
    """

    def __init__(self, dest: Path, dtype: np.dtype) -> None:
        self.dest, self.dtype, self.length = dest, dtype, 0
        self.tmp = _temporary_sibling(dest)
        self.file = self.tmp.open("x+b")
        self._write_header()
        self.data_offset = self.file.tell()

    def _write_header(self) -> None:
        self.file.seek(0)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.length,)}
        np.lib.format.write_array_header_1_0(self.file, header)

    def append(self, ids: np.ndarray) -> None:
        self.file.seek(self.data_offset + self.length * self.dtype.itemsize)
        self.file.write(np.ascontiguousarray(ids, dtype=self.dtype).data)
        self.length += len(ids)

    def tail(self, n: int) -> np.ndarray:
        """The last ``n`` ids written, memory-mapped."""
        self.file.flush()
        offset = self.data_offset + (self.length - n) * self.dtype.itemsize
        return np.memmap(self.tmp, dtype=self.dtype, mode="r", offset=offset, shape=(n,))

    def truncate(self, length: int) -> None:
        self.length = length
        self.file.truncate(self.data_offset + length * self.dtype.itemsize)

    def commit(self) -> str:
        """Finish the header, move the file to ``dest`` and return its sha256."""
        self._write_header()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.seek(0)
        digest = hashlib.file_digest(self.file, "sha256").hexdigest()
        self.file.close()
        os.replace(self.tmp, self.dest)
        return digest

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _move_tail(source: _NpyStream, dest: _NpyStream, n: int) -> None:
    """Move the last ``n`` ids of ``source`` to the end of ``dest``, a block at a time."""
    if n == 0:
        return
    tail = source.tail(n)
    for start in range(0, n, _COPY_BLOCK_IDS):
        dest.append(tail[start : start + _COPY_BLOCK_IDS])
    del tail  # unmap before the file shrinks under the map
    source.truncate(source.length - n)


def _temporary_sibling(path: Path) -> Path:
    """A fresh hidden name beside ``path``: same filesystem, so ``os.replace`` onto ``path`` is atomic.

    Unlike ``tempfile.mkstemp`` (always mode 0600), a file opened under it gets the usual umask permissions.
    """
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def _write_json_atomically(path: Path, record: dict) -> None:
    tmp = _temporary_sibling(path)
    with tmp.open("x") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _choose_tokenizer(
    tokenizer: str | Path | Tokenizer,
    vocab_size: int | None,
    sources: list[Path],
    max_bytes: int | None,
    text_key: str = "text",
) -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        chosen = tokenizer
    elif str(tokenizer) == BPETokenizer.kind:
        texts = (text for _, text in read_text_blocks(sources, max_bytes, text_key))
        return train_bpe(texts, vocab_size or DEFAULT_BPE_VOCAB_SIZE)
    else:
        chosen = load_tokenizer(tokenizer)
    if vocab_size is not None and vocab_size != chosen.vocab_size:
        raise DataError(
            f"vocab_size={vocab_size} was asked for but the {chosen.kind} tokenizer has {chosen.vocab_size} ids; "
            "drop --vocab-size or train a new one with --tokenizer bpe"
        )
    return chosen


def prepare(
    inputs: Sequence[str | Path],
    output: str | Path,
    tokenizer: str | Path | Tokenizer = "byte",
    vocab_size: int | None = None,
    max_bytes: int | None = None,
    glob: str = "*.txt",
    val_fraction: float = 0.0,
    overwrite: bool = False,
    text_key: str = "text",
) -> PreparedInfo:
    """Tokenise ``inputs`` (files, or directories searched for ``glob``) into the token file ``output``.

    ``tokenizer`` is ``"byte"``, ``"bpe"`` (trained here on the same text, ``vocab_size`` ids, default
    8192), the path of a ``tokenizer.json``, or a :class:`Tokenizer`. At most ``max_bytes`` of text are read
    (whole lines; of a jsonl or parquet file, each record's ``text_key`` field). With ``val_fraction > 0`` the
    last tokens go to ``<output stem>-val.npy``. Documents are
    concatenated in order without separators. Returns the sidecar of ``output``.
    """
    output = Path(output)
    if output.suffix != ".npy":
        raise DataError(f"output {output} must end in .npy")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    val_output = val_path_for(output) if val_fraction > 0 else None
    for path in (output, val_output):
        if path is not None and path.exists() and not overwrite:
            raise DataError(f"refusing to overwrite {path}; pass --overwrite")
    sources = collect_sources(inputs, glob)
    chosen = _choose_tokenizer(tokenizer, vocab_size, sources, max_bytes, text_key)
    output.parent.mkdir(parents=True, exist_ok=True)

    dtype = _token_dtype(chosen.vocab_size)
    used: dict[Path, None] = {}
    streams = [_NpyStream(output, dtype)]
    try:
        for source, text in read_text_blocks(sources, max_bytes, text_key):
            used[source] = None
            streams[0].append(chosen.encode(text))
        if val_output is not None:
            streams.append(_NpyStream(val_output, dtype))
            _move_tail(streams[0], streams[1], round(streams[0].length * val_fraction))
        for stream, fix in zip(streams, ("lower", "raise"), strict=False):
            if stream.length == 0:
                raise DataError(f"{stream.dest.name} would hold no tokens; add text or {fix} --val-fraction")
        digests = [stream.commit() for stream in streams]
    except BaseException:
        for stream in streams:
            stream.discard()
        raise

    tokenizer_path = None
    if isinstance(chosen, BPETokenizer):
        tokenizer_path = output.with_suffix(".tokenizer.json")
        chosen.save(tokenizer_path)
    infos = [
        PreparedInfo(
            path=stream.dest,
            tokenizer=chosen.kind,
            vocab_size=chosen.vocab_size,
            n_tokens=stream.length,
            dtype=dtype.name,
            sha256=digest,
            sources=tuple(map(str, used)),
            tokenizer_path=tokenizer_path,
            val_path=val_output if stream is streams[0] else None,
        )
        for stream, digest in zip(streams, digests, strict=True)
    ]
    for info in infos:
        _write_json_atomically(PreparedInfo.sidecar_path(info.path), info.to_json())
    return infos[0]
