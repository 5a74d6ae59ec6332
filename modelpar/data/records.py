"""Documents of a corpus: ``.txt``, ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` and ``.parquet`` files, streamed.

    sources = corpus_files(["fineweb/", "extra/*.parquet", "notes.txt"])
    for unit in read_units(sources[0], text_key="text"):
        unit.text, unit.ends_document, unit.bad          # a document, a piece of one, or a bad record

A ``.txt`` file is one document, read in pieces of whole lines so a large file never has to fit in memory; a
jsonl line or a parquet row is one document, its text under ``text_key``. Every file is read as a sequence of
*units* (pieces or records) counted from 0, so a reader can start at any unit to resume. JSON lines are
decoded by the standard library, compressed streams by ``gzip`` and ``zstandard``, parquet by ``pyarrow``
(imported only for the formats that need them). A record that cannot be used is a unit with ``bad`` set
(``invalid_json``, ``missing_key``, ``not_text``, ``not_utf8``, ``empty``), never an exception.
"""

from __future__ import annotations

import glob as globbing
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from modelpar.data.token_file import DataError

FORMATS = {".txt": "text", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".jsonl.zst": "jsonl", ".parquet": "parquet"}
BAD_REASONS = ("invalid_json", "missing_key", "not_text", "not_utf8", "empty")

# Pieces of a text file: about this many bytes, cut after a newline (never inside a UTF-8 character).
_PIECE_BYTES = 1 << 20
_PARQUET_ROWS = 1024


@dataclass(frozen=True)
class Unit:
    """One readable step of a file: ``text`` of a document or piece (None when ``bad`` names why not)."""

    text: str | None
    ends_document: bool = True
    bad: str | None = None


def suffix_of(path: Path) -> str:
    """The corpus suffix of ``path`` (``.jsonl.gz`` counts as one), or ``""``."""
    name = path.name.lower()
    return next((s for s in sorted(FORMATS, key=len, reverse=True) if name.endswith(s)), "")


def _check_format(path: Path) -> Path:
    if not suffix_of(path):
        raise DataError(
            f"{path} has an unknown extension; prepare reads {', '.join(FORMATS)} files "
            "(rename it, or convert it to jsonl)"
        )
    return path


def corpus_files(inputs: Sequence[str | Path]) -> list[Path]:
    """Files named by ``inputs`` (files, directories searched recursively, or glob patterns), in a fixed order.

    Input order is kept; a directory's or pattern's matches are sorted by path; a file named twice is read once.
    A named file (or pattern match) with an extension not in ``FORMATS`` is an error; inside a directory such
    files are passed over.
    """
    found: dict[Path, None] = {}
    for item in map(str, inputs):
        path = Path(item)
        if path.is_file():
            found[_check_format(path)] = None
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and suffix_of(p))
            if not files:
                raise DataError(f"{path} holds no {', '.join(FORMATS)} files; pass corpus files or directories")
            found.update(dict.fromkeys(files))
        elif globbing.has_magic(item):
            matches = sorted(Path(p) for p in globbing.glob(item, recursive=True) if os.path.isfile(p))
            if not matches:
                raise DataError(f"no files match {item!r}; check the pattern (quote it so the shell leaves it alone)")
            found.update(dict.fromkeys(map(_check_format, matches)))
        else:
            raise DataError(f"input {item} does not exist; pass corpus files, directories or glob patterns")
    return list(found)


class SourceReader:
    """Streams the units of one corpus file; ``bytes_read`` says how far into the file (on disk) it is."""

    def __init__(self, path: Path, text_key: str = "text"):
        self.path, self.text_key = path, text_key
        self.format = FORMATS[suffix_of(path)]
        self.size = path.stat().st_size
        self.bytes_read = 0
        self.first_keys: list[str] | None = None  # the keys of the first JSON record (to suggest --text-key)

    def units(self, start: int = 0) -> Iterator[Unit]:
        """Units ``start, start + 1, ...`` to the end of the file (skipped units are read, not decoded)."""
        read = {"text": self._text_units, "jsonl": self._jsonl_units, "parquet": self._parquet_units}[self.format]
        yield from read(start)
        self.bytes_read = self.size

    def _text_units(self, start: int) -> Iterator[Unit]:
        held, count = None, 0  # a piece is held back until the next shows whether it was the file's last
        for piece in self._text_pieces():
            if held is not None and count - 1 >= start:
                yield _text_unit(held, last=False)
            held, count = piece, count + 1
        if count - 1 >= start:
            yield _text_unit(held, last=True, whole=count == 1)

    def _text_pieces(self) -> Iterator[bytes]:
        """The file in pieces of about ``_PIECE_BYTES`` cut after a newline; at least one (maybe empty)."""
        with self.path.open("rb") as f:
            pending, pieces = b"", 0
            while True:
                chunk = f.read(_PIECE_BYTES)
                self.bytes_read = f.tell()
                data = pending + chunk
                cut = data.rfind(b"\n") + 1 if chunk else len(data)
                if chunk and not cut:
                    pending = data  # one very long line: read on until it ends
                    continue
                pending = data[cut:]
                if cut or not pieces:
                    pieces += 1
                    yield data[:cut]
                if not chunk:
                    return

    def _open_jsonl(self, raw: BinaryIO) -> BinaryIO:
        name = self.path.name.lower()
        if name.endswith(".gz"):
            return gzip.GzipFile(fileobj=raw)
        if name.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                raise DataError(f"{self.path} is zstd-compressed; install the reader: pip install zstandard") from None
            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), buffer_size=1 << 20)
        return raw

    def _jsonl_units(self, start: int) -> Iterator[Unit]:
        with self.path.open("rb") as raw, self._open_jsonl(raw) as stream:
            for index, line in enumerate(stream):
                if index % 256 == 0:
                    self.bytes_read = raw.tell()
                if index < start:
                    continue
                yield self._json_unit(line) if line.strip() else Unit(None, bad="empty")

    def _json_unit(self, line: bytes) -> Unit:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            return Unit(None, bad="not_utf8")
        try:
            record = json.loads(text)
        except ValueError:
            return Unit(None, bad="invalid_json")
        if not isinstance(record, dict):
            return Unit(None, bad="missing_key")
        if self.first_keys is None:
            self.first_keys = list(record)[:8]
        if self.text_key not in record:
            return Unit(None, bad="missing_key")
        return _document(record[self.text_key], escaped="\\ud" in text or "\\uD" in text)

    def _parquet_units(self, start: int) -> Iterator[Unit]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{self.path} is parquet; install the reader: pip install pyarrow") from None
        try:
            # pre-buffering keeps whole column chunks in arrow's pool as it goes (memory grew with the file)
            parquet = pq.ParquetFile(self.path, pre_buffer=False, buffer_size=1 << 20)
        except Exception as e:  # noqa: BLE001 -- pyarrow raises ArrowInvalid/OSError variants for a bad file
            raise DataError(f"{self.path} is not a readable parquet file ({' '.join(str(e).split())})") from None
        names = parquet.schema_arrow.names
        self.first_keys = names[:8]
        rows = parquet.metadata.num_rows
        if self.text_key not in names:
            yield from (Unit(None, bad="missing_key") for _ in range(start, rows))
            return
        index = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_ROWS, columns=[self.text_key], use_threads=False):
            values: list[Any] = batch.column(0).to_pylist()
            index += len(values)
            self.bytes_read = self.size * index // max(rows, 1)
            if index <= start:
                continue
            for value in values[max(0, start - (index - len(values))) :]:
                yield _document(value, escaped=False)


def _text_unit(data: bytes, last: bool, whole: bool = False) -> Unit:
    """A piece of a text file; ``whole``: the piece is the entire file (so blank means an empty document)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Unit(None, ends_document=last, bad="not_utf8")
    if whole and not text.strip():
        return Unit(None, bad="empty")
    return Unit(text, ends_document=last)


def _document(value: Any, escaped: bool) -> Unit:
    """A record's text field as a unit: a non-empty string that encodes to UTF-8."""
    if value is None:
        return Unit(None, bad="missing_key")
    if not isinstance(value, str):
        return Unit(None, bad="not_text")
    if not value.strip():
        return Unit(None, bad="empty")
    if escaped:  # only a JSON \\ud800-style escape can smuggle a lone surrogate into a str
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return Unit(None, bad="not_utf8")
    return Unit(value)
