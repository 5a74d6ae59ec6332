"""``modelpar-data``: prepare, inspect and build token files from the shell.

    modelpar-data prepare notes/ book.txt --output data/corpus.npy --tokenizer bpe --vocab-size 4096
    modelpar-data prepare 'web/*.jsonl.zst' pages.parquet --output data/web --tokenizer models/llama --workers 8
    modelpar-data inspect data/corpus.npy --seq-len 512
    modelpar-data inspect data/web
    modelpar-data corpus --cache-dir data/cache

A problem with the data is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from modelpar.cli.args import positive_int
from modelpar.data.corpus import DEFAULT_CORPUS_BYTES, DEFAULT_VAL_FRACTION, default_corpus
from modelpar.data.prepare import PreparedInfo, prepare, tokenizer_for
from modelpar.data.prepare_shards import DEFAULT_SHARD_TOKENS, prepare_shards
from modelpar.data.shards import read_manifest, shard_files
from modelpar.data.token_file import DataError, TokenFile, max_token_id, open_tokens
from modelpar.training.config import DataConfig, EvalConfig

_SAMPLE_TOKENS = 64


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpar-data", description="Token files for modelpar training.")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser(
        "prepare",
        help="tokenise a corpus into a shard directory (--output DIR) or text files into one token file (OUT.npy)",
    )
    p.add_argument(
        "inputs", nargs="+", help=".txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet files, directories or glob patterns"
    )
    p.add_argument("--output", "-o", type=Path, required=True, help="a directory of shards, or a token file (.npy)")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default), a tokenizer.json, a Hugging Face model directory, or "
        "bpe (trained here; .npy output only)",
    )
    p.add_argument("--text-key", default="text", help="the field of a jsonl record or parquet row holding the text")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1; 0: this process)")
    p.add_argument("--shard-tokens", type=positive_int, default=DEFAULT_SHARD_TOKENS, help="ids per shard")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of counting it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--vocab-size", type=positive_int, help="bpe vocabulary size (default 8192; .npy output)")
    p.add_argument("--max-bytes", type=positive_int, help="read at most this many bytes of text (.npy output)")
    p.add_argument("--glob", default="*.txt", help="file pattern inside directories (.npy output; default *.txt)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="hold out this fraction: every 1/f-th document (DIR/val) or the last tokens (OUT-val.npy)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")

    p = commands.add_parser("inspect", help="describe a token file or shard directory")
    p.add_argument("file", type=Path)
    p.add_argument("--seq-len", type=positive_int, default=1024, help="window length to count windows for")
    p.add_argument("--vocab-size", type=positive_int, help="also check the file against this model vocabulary")

    p = commands.add_parser("corpus", help="build (or find) the default Python-stdlib corpus")
    p.add_argument("--cache-dir", type=Path, default=Path("data/cache"))
    p.add_argument("--max-bytes", type=positive_int, default=DEFAULT_CORPUS_BYTES)
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION)
    return parser


def _describe(info: PreparedInfo) -> None:
    print(f"wrote {info.path}: {info.n_tokens:,} {info.dtype} tokens, {info.tokenizer} vocab {info.vocab_size}")
    for path in (info.val_path, info.tokenizer_path):
        if path is not None:
            print(f"wrote {path}")


def _prepare(args: argparse.Namespace) -> None:
    if args.output.suffix != ".npy":
        _prepare_shards(args)
        return
    _describe(
        prepare(
            args.inputs,
            args.output,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            max_bytes=args.max_bytes,
            glob=args.glob,
            val_fraction=args.val_fraction,
            overwrite=args.overwrite,
            text_key=args.text_key,
        )
    )


def _prepare_shards(args: argparse.Namespace) -> None:
    for flag, given in (("--max-bytes", args.max_bytes), ("--vocab-size", args.vocab_size), ("--glob", args.glob)):
        if given is not None and given != "*.txt":
            raise DataError(f"{flag} applies to a .npy output only; a shard directory takes every document")
    fresh = not Path(args.output).exists()
    try:
        result = prepare_shards(
            args.inputs,
            args.output,
            tokenizer=args.tokenizer,
            text_key=args.text_key,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            val_fraction=args.val_fraction,
            strict=args.strict,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except DataError:
        # refused data leaves nothing behind (an interrupted prepare keeps its partial shards: a rerun resumes them)
        if fresh and not (Path(args.output) / "manifest.json").exists():
            shutil.rmtree(args.output, ignore_errors=True)
        raise
    m = result.manifest
    if result.already:
        print(f"{args.output} is already prepared with these settings ({m['tokens']:,} tokens); nothing to do")
        return
    bad = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in m["bad_records"].items() if n) or "none"
    print(
        f"wrote {args.output}: {m['tokens']:,} {m['dtype']} tokens of {m['documents']:,} documents in "
        f"{len(m['shards'])} shards ({m['tokenizer']['kind']} vocab {m['tokenizer']['vocab_size']}); bad records: {bad}"
    )
    if m["val"]:
        val = read_manifest(args.output / m["val"])
        print(f"wrote {args.output / m['val']}: {val['tokens']:,} held-out tokens of {val['documents']:,} documents")
        warn_small_held_out(val["tokens"], args.val_fraction)


def warn_small_held_out(tokens: int, val_fraction: float) -> None:
    """A held-out split too small for modelpar-eval's default windows (and the trainer's closing sample) is
    said now, naming the option, rather than when training ends."""
    windows, seq_len = EvalConfig().windows, DataConfig().seq_len
    if tokens < windows * seq_len + 1:
        print(
            f"modelpar-data: warning: the held-out split has {tokens:,} tokens, fewer than modelpar-eval's default "
            f"{windows} windows of {seq_len + 1}; raise --val-fraction (now {val_fraction:g}) or add documents",
            file=sys.stderr,
        )


def _inspect_shards(args: argparse.Namespace) -> None:
    m = read_manifest(args.file)
    rows = {
        "directory": str(args.file),
        "tokens": f"{m['tokens']:,} {m['dtype']} in {len(m['shards'])} shards of up to {m['shard_tokens']:,}",
        "documents": f"{m['documents']:,}",
        "tokenizer": f"{m['tokenizer']['kind']}, vocab {m['tokenizer']['vocab_size']}, eos {m['tokenizer']['eos_id']}",
        "sources": f"{len(m['settings']['sources'])} files",
        "bad": ", ".join(f"{n} {k}" for k, n in m["bad_records"].items() if n) or "none",
        "held out": str(args.file / m["val"]) if m["val"] else "none",
    }
    vocab = args.vocab_size or m["tokenizer"]["vocab_size"]
    files = shard_files(args.file, vocab, args.seq_len)
    rows["windows"] = f"{sum(f.num_windows for f in files):,} of seq_len {args.seq_len}"
    rows["sample"] = repr(tokenizer_for(args.file).decode(files[0].tokens[:_SAMPLE_TOKENS]))
    for name, value in rows.items():
        print(f"{name:<10} {value}")


def _inspect(args: argparse.Namespace) -> None:
    if args.file.is_dir():
        _inspect_shards(args)
        return
    tokens = open_tokens(args.file)
    if len(tokens) == 0:
        raise DataError(f"{args.file} holds no tokens")
    rows = {
        "file": str(args.file),
        "dtype": str(tokens.dtype),
        "tokens": f"{len(tokens):,}",
        "max id": str(max_token_id(tokens)),
        "windows": f"{(len(tokens) - 1) // args.seq_len:,} of seq_len {args.seq_len}",
    }
    if PreparedInfo.sidecar_path(args.file).is_file():
        info = PreparedInfo.read(args.file)
        rows["tokenizer"] = f"{info.tokenizer}, vocab {info.vocab_size}"
        rows["sources"] = f"{len(info.sources)} files"
        rows["sample"] = repr(tokenizer_for(args.file).decode(tokens[:_SAMPLE_TOKENS]))
    if args.vocab_size is not None:
        TokenFile.open(args.file, args.vocab_size, args.seq_len)
        rows["check"] = f"fits vocab_size {args.vocab_size}"
    for name, value in rows.items():
        print(f"{name:<10} {value}")


def _corpus(args: argparse.Namespace) -> None:
    info = default_corpus(args.cache_dir, max_bytes=args.max_bytes, val_fraction=args.val_fraction)
    print(f"train {info.path} ({info.n_tokens:,} tokens)")
    print(f"val   {info.val_path} ({PreparedInfo.read(info.val_path).n_tokens:,} tokens)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (2 for unusable data)."""
    args = _parser().parse_args(argv)
    command = {"prepare": _prepare, "inspect": _inspect, "corpus": _corpus}[args.command]
    try:
        command(args)
    except DataError as e:
        print(f"modelpar-data: error: {e}", file=sys.stderr)
        return 2
    return 0
