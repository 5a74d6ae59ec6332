"""argparse types for the command-line tools: a bad number is refused in one line, before any work starts.

parser.add_argument("--rounds", type=positive_int, default=3)
# --rounds 0  ->  error: argument --rounds: '0' is not a positive integer
"""

from __future__ import annotations

import argparse
import math

from modelpar.bench.layout_spec import parse_layout
from modelpar.training.config import ParallelConfig


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def check_layouts(parser: argparse.ArgumentParser, specs: list[str]) -> None:
    """Every ``--layouts`` entry reads as a ``modelpar-bench`` layout spec (e.g. ``tp2-pp2-1f1b``), or the
    parser exits with one line naming the entry and the accepted words."""
    for spec in specs:
        try:
            parse_layout(spec, ParallelConfig())
        except ValueError as exc:
            parser.error(str(exc).replace("bench.sweep entry", "layout"))
