"""``modelpar-data``: prepare, inspect and build token files from the shell.

    modelpar-data prepare notes/ book.txt --output data/corpus.npy --tokenizer bpe --vocab-size 4096
    modelpar-data inspect data/corpus.npy --seq-len 512
    modelpar-data corpus --cache-dir data/cache

A problem with the data is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from modelpar.cli.args import positive_int
from modelpar.data.corpus import DEFAULT_CORPUS_BYTES, DEFAULT_VAL_FRACTION, default_corpus
from modelpar.data.prepare import PreparedInfo, prepare, tokenizer_for
from modelpar.data.token_file import DataError, TokenFile, max_token_id, open_tokens

_SAMPLE_TOKENS = 64


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpar-data", description="Token files for modelpar training.")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("prepare", help="tokenise text files into a .npy token file")
    p.add_argument("inputs", nargs="+", type=Path, help="text files, or directories searched for --glob")
    p.add_argument("--output", "-o", type=Path, required=True, help="token file to write (.npy)")
    p.add_argument("--tokenizer", default="byte", help="byte (default), bpe (trained here) or a tokenizer.json")
    p.add_argument("--vocab-size", type=positive_int, help="bpe vocabulary size (default 8192)")
    p.add_argument("--max-bytes", type=positive_int, help="read at most this many bytes of text")
    p.add_argument("--glob", default="*.txt", help="file pattern inside directories (default *.txt)")
    p.add_argument("--val-fraction", type=float, default=0.0, help="hold out the last tokens as OUT-val.npy")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")

    p = commands.add_parser("inspect", help="describe a token file")
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
        )
    )


def _inspect(args: argparse.Namespace) -> None:
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
