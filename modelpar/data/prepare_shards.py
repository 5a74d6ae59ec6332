"""Prepare a corpus into a shard directory: stream documents, tokenise them in worker processes, write shards.

    prepare_shards(["fineweb/*.parquet"], "data/fineweb", tokenizer="models/llama", workers=8)

The main process reads documents (``modelpar.data.records``) in order and hands batches of about
``batch_bytes`` of text to ``workers`` processes; at most ``2 * workers`` batches are out at once, so memory is
bounded by the batches, not by the corpus. Results are written in submission order, so the token stream
depends only on the inputs and settings (never on ``workers`` or timing)::

    doc 0 ids EOS | doc 1 ids EOS | ...     cut every ``shard_tokens`` ids into shard-00000.npy, shard-00001.npy

Every ``1 / val_fraction``-th document, the first included, goes to the held-out split ``val/`` instead (the
same rule, so the same documents, every time). Resuming: after each finished shard the manifest records where
reading stands (file, unit), the counts so far and how much of each unfinished shard is written, after an
fsync; a rerun of the same command truncates the unfinished shards to that point and reads on from there, so an
interrupted prepare ends with the same bytes as an uninterrupted one. A finished prepare is not redone.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from modelpar.data.prepare import _token_dtype, _write_json_atomically
from modelpar.data.records import BAD_REASONS, SourceReader, corpus_files
from modelpar.data.shard_writer import SplitWriter
from modelpar.data.shards import MANIFEST, MANIFEST_FORMAT, VAL_SPLIT
from modelpar.data.token_file import DataError
from modelpar.data.tokenize_pool import tokenize_batch, tokenizer_pool
from modelpar.data.tokenizer import BPETokenizer, Tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MB of uint16 ids
DEFAULT_BATCH_BYTES = 1 << 20
TOKENIZER_FILE = "tokenizer.json"


def is_held_out(document: int, val_fraction: float) -> bool:
    """Whether document ``document`` (counted from 0) goes to the held-out split: every ``1/f``-th does,
    starting with the first, so any fraction > 0 of a corpus holds out at least one document."""
    return math.ceil((document + 1) * val_fraction) > math.ceil(document * val_fraction)


# -- the prepare -----------------------------------------------------------------------------------------------


@dataclass
class _Cursor:
    """Where reading stands after a batch: the next unit to read, and everything counted up to it."""

    source: int = 0
    unit: int = 0
    documents: int = 0  # documents started
    open_document: bool = False  # the last document's end is still to come (a text file read in pieces)
    bad: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "unit": self.unit,
            "documents": self.documents,
            "open_document": self.open_document,
            "bad": dict(self.bad),
        }


@dataclass(frozen=True)
class PrepareResult:
    """What a call did: ``manifest`` (the directory's), ``done`` (False: stopped early, resumable), ``resumed``."""

    manifest: dict
    done: bool
    resumed: bool = False
    already: bool = False


def _choose(tokenizer: str | Path | Tokenizer) -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if str(tokenizer) == BPETokenizer.kind:
        raise DataError(
            "--tokenizer bpe trains a tokenizer, which a streaming prepare cannot do in one pass; train one with "
            "`modelpar-data prepare SAMPLE --output sample.npy --tokenizer bpe` and pass sample.tokenizer.json"
        )
    return load_tokenizer(tokenizer)


def _owned(output: Path) -> list[Path]:
    """The files a prepare writes in ``output`` (what --overwrite removes; nothing else is touched)."""
    found = []
    for folder in (output, output / VAL_SPLIT):
        if folder.is_dir():
            found += [folder / MANIFEST, folder / TOKENIZER_FILE, *folder.glob("shard-*.npy")]
            found += [*folder.glob(".shard-*.npy.partial"), *folder.glob("*.fingerprint.json")]
    return [p for p in found if p.exists()]


def prepare_shards(
    inputs: Sequence[str | Path],
    output: str | Path,
    tokenizer: str | Path | Tokenizer = "byte",
    text_key: str = "text",
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = 0.0,
    strict: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    stop_after_shards: int | None = None,
) -> PrepareResult:
    """Tokenise the documents of ``inputs`` into shards of ``shard_tokens`` ids in the directory ``output``.

    ``inputs``: corpus files, directories or glob patterns (``modelpar.data.records``); ``tokenizer``: ``byte``,
    a ``tokenizer.json`` or a Hugging Face model directory; ``workers``: tokenising processes (0: this one).
    Bad records are counted in the manifest, or with ``strict`` the first one is an error. With
    ``stop_after_shards`` the call returns once that many training shards exist, resumable (``done`` False).
    """
    output = Path(output)
    if output.suffix == ".npy":
        raise DataError(f"output {output} is a token file name; a streaming prepare writes a directory of shards")
    for name, value, low in (
        ("shard_tokens", shard_tokens, 1),
        ("workers", workers, 0),
        ("batch_bytes", batch_bytes, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DataError(f"{name}={value!r} must be an integer >= {low}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    sources = corpus_files(inputs)
    chosen = _choose(tokenizer)
    if chosen.eos_id is None:
        raise DataError(
            f"tokenizer {tokenizer} has no end-of-text token to end documents with (an eos_token in its "
            "tokenizer_config.json, or one of <|endoftext|>, </s>, <|end_of_text|>, <eos>); use one that has it"
        )
    dtype = _token_dtype(chosen.vocab_size)
    settings = {
        "format": MANIFEST_FORMAT,
        "sources": [{"path": str(p), "size": p.stat().st_size} for p in sources],
        "tokenizer": chosen.fingerprint,
        "text_key": text_key,
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
    }
    manifest_path = output / MANIFEST
    state = None
    if overwrite:
        for path in _owned(output):
            path.unlink()
    elif manifest_path.is_file():
        previous = _read_own_manifest(manifest_path)
        if previous.get("settings") != settings:
            differ = _difference(previous.get("settings") or {}, settings)
            raise DataError(
                f"{output} holds a prepare with other settings ({differ}); rerun it with its settings, pass "
                "--overwrite, or choose another --output"
            )
        if previous["complete"]:
            return PrepareResult(previous, done=True, already=True)
        state = previous["state"]
    elif output.is_dir():
        owned = set(_owned(output))  # a prepare that failed before its first shard left only its own files
        if any(p not in owned and p.name != VAL_SPLIT for p in output.iterdir()):
            raise DataError(f"{output} exists and is not a prepared directory; choose another --output or empty it")
    output.mkdir(parents=True, exist_ok=True)

    tokenizer_info = {
        "kind": chosen.kind,
        "fingerprint": chosen.fingerprint,
        "vocab_size": chosen.vocab_size,
        "eos_id": chosen.eos_id,
        "file": None,
        "source": str(tokenizer) if not isinstance(tokenizer, Tokenizer) else chosen.kind,
    }
    if isinstance(chosen, BPETokenizer):
        chosen.save(output / TOKENIZER_FILE)
        tokenizer_info["file"] = TOKENIZER_FILE
    head = {
        "format": MANIFEST_FORMAT,
        "settings": settings,
        "tokenizer": tokenizer_info,
        "dtype": dtype.name,
        "shard_tokens": shard_tokens,
    }
    run = _Run(
        output, sources, chosen, dtype, head, text_key, val_fraction, strict, batch_bytes, workers, stop_after_shards
    )
    return run.go(state, progress)


def _read_own_manifest(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
        if "complete" not in record:
            raise KeyError("complete")  # not a manifest this module wrote
        return record
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"cannot read {path} ({type(e).__name__}: {e}); pass --overwrite to prepare again") from None


def _difference(old: dict, new: dict) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if keys == ["sources"]:
        return "its source files or their sizes differ"
    return ", ".join(f"{k} {old.get(k)!r} now {new.get(k)!r}" for k in keys if k != "sources") or "format"


class _Run:
    """One pass of a prepare from a cursor to the end (or to ``stop_after_shards``)."""

    def __init__(
        self, output, sources, tokenizer, dtype, head, text_key, val_fraction, strict, batch_bytes, workers, stop
    ):
        self.output, self.sources, self.tokenizer, self.dtype, self.head = output, sources, tokenizer, dtype, head
        self.text_key, self.val_fraction, self.strict = text_key, val_fraction, strict
        self.batch_bytes, self.workers, self.stop = batch_bytes, workers, stop

    def go(self, state: dict | None, progress: bool) -> PrepareResult:
        shard_tokens = self.head["shard_tokens"]
        self.train = SplitWriter(self.output, self.dtype, shard_tokens, state and state["train"])
        self.val = SplitWriter(self.output / VAL_SPLIT, self.dtype, shard_tokens, state and state["val"])
        cursor = _Cursor(**state["cursor"]) if state else _Cursor()
        sizes = [p.stat().st_size for p in self.sources]
        self.before = np.concatenate([[0], np.cumsum(sizes)]).tolist()  # bytes of the sources before each
        bar = _Progress(self.before[-1], progress)
        pool = tokenizer_pool(self.workers, self.tokenizer, self.dtype)
        in_flight: deque = deque()
        limit = 2 * max(self.workers, 1)
        try:
            for batch, after in self._batches(cursor, bar):
                in_flight.append((pool.apply_async(tokenize_batch, (batch,)), after))
                while len(in_flight) >= limit:
                    if self._write(*in_flight.popleft(), bar):
                        return self._stopped(state)
            while in_flight:
                if self._write(*in_flight.popleft(), bar):
                    return self._stopped(state)
        except BaseException:
            pool.terminate()
            self.train.current.close()
            self.val.current.close()
            raise
        finally:
            bar.close()
        pool.terminate()
        pool.join()
        return self._finish(self._last_cursor)

    def _batches(self, cursor: _Cursor, bar: _Progress):
        """``(batch, cursor after it)`` from ``cursor`` to the end of the last source."""
        c = _Cursor(cursor.source, cursor.unit, cursor.documents, cursor.open_document, Counter(cursor.bad))
        # resuming inside a document (a text file read in pieces): its pieces go where its first one went
        held = c.open_document and is_held_out(c.documents - 1, self.val_fraction)
        batch, size = [], 0
        for index in range(c.source, len(self.sources)):
            path = self.sources[index]
            reader = SourceReader(path, self.text_key)
            start = c.unit if index == c.source else 0
            good = bad_keys = 0
            for unit_index, unit in enumerate(reader.units(start), start=start):
                if unit.bad:
                    c.bad[unit.bad] += 1
                    bad_keys += unit.bad == "missing_key"
                    if self.strict:
                        raise DataError(
                            f"{path}: record {unit_index + 1} is bad ({unit.bad.replace('_', ' ')}); fix or drop it, "
                            "or prepare without --strict to count and skip bad records"
                        )
                    if not (unit.ends_document and c.open_document):
                        continue
                    text = ""  # a text file's unreadable last piece: still end the document
                else:
                    text = unit.text
                    good += 1
                    if not c.open_document:
                        held = is_held_out(c.documents, self.val_fraction)
                        c.documents += 1
                batch.append((text, unit.ends_document, held))
                c.open_document = not unit.ends_document
                size += len(text)
                if size >= self.batch_bytes:
                    bar.at(self.before[index] + reader.bytes_read)
                    yield batch, self._snapshot(c, index, unit_index + 1)
                    batch, size = [], 0
            if start == 0 and not good and bad_keys:
                keys = f" (its first record has {', '.join(reader.first_keys)})" if reader.first_keys else ""
                raise DataError(
                    f"no record of {path} has the text key {self.text_key!r}{keys}; pass --text-key with the field "
                    "that holds the text"
                )
            c.source, c.unit = index + 1, 0
            bar.at(self.before[index + 1])
        self._last_cursor = self._snapshot(c, len(self.sources), 0)
        if batch:
            yield batch, self._last_cursor

    @staticmethod
    def _snapshot(c: _Cursor, source: int, unit: int) -> _Cursor:
        return _Cursor(source, unit, c.documents, c.open_document, dict(c.bad))

    def _write(self, result, after: _Cursor, bar: _Progress) -> bool:
        """Write one batch's ids; after a finished shard, save the resume point. True: stop here."""
        train_ids, train_ends, val_ids, val_ends = result.get()
        committed = self.train.write(train_ids, train_ends) + self.val.write(val_ids, val_ends)
        bar.tokens(len(train_ids) + len(val_ids))
        if committed:
            self._save(after)
            if self.stop is not None and len(self.train.shards) >= self.stop:
                return True
        return False

    def _save(self, cursor: _Cursor) -> None:
        state = {"cursor": cursor.to_json(), "train": self.train.state(), "val": self.val.state()}
        _write_json_atomically(
            self.output / MANIFEST,
            {**self.head, "complete": False, "shards": self.train.shards, "state": state},
        )

    def _stopped(self, state) -> PrepareResult:
        self.train.current.close()
        self.val.current.close()
        return PrepareResult(_read_own_manifest(self.output / MANIFEST), done=False, resumed=state is not None)

    def _finish(self, cursor_after: _Cursor | None) -> PrepareResult:
        self.train.finish()
        self.val.finish()
        bad = {k: v for k, v in sorted((cursor_after.bad if cursor_after else {}).items()) if v}
        if self.train.tokens == 0:
            listing = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in bad.items()) or "no records"
            raise DataError(f"no usable document in {', '.join(map(str, self.sources))} ({listing})")
        counts = {"documents": self.train.documents, "tokens": self.train.tokens}
        if self.val_fraction > 0:
            tokenizer = dict(self.head["tokenizer"])
            if tokenizer["file"]:
                tokenizer["file"] = f"../{tokenizer['file']}"
            val = {
                **self.head,
                "tokenizer": tokenizer,
                "complete": True,
                "split": VAL_SPLIT,
                "documents": self.val.documents,
                "tokens": self.val.tokens,
                "shards": self.val.shards,
            }
            _write_json_atomically(self.output / VAL_SPLIT / MANIFEST, val)
        else:
            (self.output / VAL_SPLIT).rmdir()
        manifest = {
            **self.head,
            "complete": True,
            **counts,
            "bad_records": {reason: bad.get(reason, 0) for reason in BAD_REASONS},
            "shards": self.train.shards,
            "val": VAL_SPLIT if self.val_fraction > 0 else None,
        }
        _write_json_atomically(self.output / MANIFEST, manifest)
        return PrepareResult(manifest, done=True)


class _Progress:
    """A tqdm bar over the input bytes, with tokens/s beside MB/s (nothing when off)."""

    def __init__(self, total: int, on: bool):
        self.bar = None
        self.done_bytes = self.token_count = 0
        if on:
            from tqdm import tqdm

            self.bar = tqdm(  # tqdm's scaled units divide by 1024 per prefix: k, M, G of bytes are KiB, MiB, GiB
                total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare", file=sys.stderr
            )

    def at(self, nbytes: int) -> None:
        """The input is read up to ``nbytes`` (of all sources together)."""
        if self.bar is not None and nbytes > self.done_bytes:
            self.bar.update(nbytes - self.done_bytes)
        self.done_bytes = max(self.done_bytes, nbytes)

    def tokens(self, n: int) -> None:
        self.token_count += n
        if self.bar is not None:
            elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.set_postfix_str(f"{self.token_count / elapsed:,.0f} tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
