"""The default corpus: Python's own standard library source, tokenised byte-level.

Every machine that runs modelpar has it, so a recipe can train and evaluate on real text without a
download. It is built once into a cache folder and reused; the file name carries a hash of everything that
shapes its content (Python version, byte cap, split), so changing a setting builds a new file instead of
silently reading a stale one::

    data/cache/stdlib-byte-<key>.npy        training tokens (uint16)
    data/cache/stdlib-byte-<key>-val.npy    held-out tokens: the last ``val_fraction`` of the text
    data/cache/stdlib-byte-<key>.json       sidecars (see ``modelpar.data.prepare``)
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from pathlib import Path

from modelpar.data.prepare import SIDECAR_FORMAT, PreparedInfo, prepare
from modelpar.data.token_file import DataError

DEFAULT_CORPUS_BYTES = 4_000_000
DEFAULT_VAL_FRACTION = 0.05

# Tests are full of deliberately odd code, codec tables and pydoc topics are generated text, and installed
# packages and build configuration differ between machines: none belongs in a corpus meant to be the same
# readable Python everywhere.
SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
)
SKIPPED_PREFIXES = ("config-", "_sysconfigdata")


def _is_skipped(relative: Path) -> bool:
    return any(part in SKIPPED_DIRS or part.startswith(SKIPPED_PREFIXES) for part in relative.parts)


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files of the standard library at ``root`` (default: this Python's), sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _is_skipped(p.relative_to(root)))
    if not files:
        raise DataError(f"no standard-library .py files under {root}; prepare a corpus with `modelpar-data prepare`")
    return files


def default_corpus(
    cache_dir: str | Path = "data/cache",
    max_bytes: int = DEFAULT_CORPUS_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> PreparedInfo:
    """Build (first call) or reuse the standard-library corpus in ``cache_dir``.

    Returns the training file's sidecar: ``.path`` for training and ``.val_path`` for evaluation.
    """
    settings = {
        "corpus": "python-stdlib",
        "python": platform.python_version(),
        "tokenizer": "byte",
        "max_bytes": max_bytes,
        "val_fraction": val_fraction,
        "format": SIDECAR_FORMAT,
        "skipped": [sorted(SKIPPED_DIRS), SKIPPED_PREFIXES],
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    output = Path(cache_dir) / f"stdlib-byte-{key}.npy"
    # Sidecars are written last, so their presence means the token files beside them are complete.
    if PreparedInfo.sidecar_path(output).is_file():
        info = PreparedInfo.read(output)
        if info.path.is_file() and info.val_path is not None and PreparedInfo.sidecar_path(info.val_path).is_file():
            return info
    print(  # the default is relative to where the command runs: say where the text goes
        f"modelpar: building the default corpus (Python's standard library, {max_bytes:,} bytes) in "
        f"{Path(cache_dir).resolve()} (data.cache_dir, relative to the current directory unless absolute)",
        flush=True,
    )
    # Ranks that race here each write the same bytes and replace atomically, so whichever wins is right.
    return prepare(
        stdlib_sources(),
        output,
        tokenizer="byte",
        max_bytes=max_bytes,
        glob="*.py",
        val_fraction=val_fraction,
        overwrite=True,
    )
