"""Token files: a memory-mapped 1-D ``.npy`` stream of token ids, cut into training windows.

A token file is the only thing training reads. It is opened with ``mmap_mode="r"`` so every rank maps the
same pages instead of holding its own copy, and never with pickle: a ``.npy`` of Python objects is refused.

Window ``i`` covers tokens ``[i*s, i*s + s + 1)`` for ``seq_len`` ``s``; consecutive windows share one
token (the last target of ``i`` is the first input of ``i + 1``), so no token is wasted as an input::

    tokens   t0 t1 t2 t3 t4 t5 t6 t7 t8        seq_len = 4, num_windows = (9 - 1) // 4 = 2
    window 0 [t0 t1 t2 t3 t4]
    window 1             [t4 t5 t6 t7 t8]
    inputs   = window[:-1]   targets = window[1:]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32))

# Enough ids per chunk to amortise numpy's per-call cost, small enough (64 MB as int64) to stay out of the way
# of training on a many-billion-token file.
_SCAN_CHUNK = 8 * 1024 * 1024

# Version 3.0 only differs for structured dtypes with non-ASCII field names, which are never token ids.
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class DataError(ValueError):
    """Unusable training data; the message is one line naming the problem and a fix."""


def open_tokens(path: str | Path) -> np.ndarray:
    """Memory-map the token ids of ``path``: 1-D, uint16 or uint32, read-only, without pickle.

    The header is checked before mapping, so a wrong file is named before any of its data is touched.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {path} does not exist; create it with `modelpar-data prepare`")
    try:
        with path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = _HEADER_READERS.get(version)
            if read_header is None:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, fortran_order, dtype = read_header(f)
            data_offset = f.tell()
    except Exception as e:  # noqa: BLE001 - an untrusted header may fail numpy's parser in any way; one line
        reason = " ".join(str(e).split())
        raise DataError(
            f"{path} is not a readable .npy file ({reason}); token files are written by np.save or "
            "`modelpar-data prepare`"
        ) from None
    if dtype.hasobject:
        raise DataError(
            f"{path} holds Python objects (dtype {dtype}), which would need pickle to load and is refused; "
            "save the ids as a uint16 or uint32 array"
        )
    if dtype.kind != "u" or dtype.itemsize not in (2, 4):
        raise DataError(
            f"{path} has dtype {dtype}; token ids must be uint16 or uint32 "
            f"(convert with np.save(path, np.asarray(ids).astype(np.uint32)))"
        )
    if len(shape) != 1:
        raise DataError(
            f"{path} has shape {shape}; a token file is a 1-D stream of ids "
            "(flatten it with np.save(path, ids.reshape(-1)))"
        )
    need = data_offset + int(np.prod(shape, dtype=object)) * dtype.itemsize
    size = path.stat().st_size
    if size < need:
        raise DataError(
            f"{path} is truncated: its header promises {need} bytes but the file has {size}; prepare it again "
            "with `modelpar-data prepare`"
        )
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        reason = " ".join(str(e).split())
        raise DataError(f"{path} cannot be mapped ({reason}); prepare it again with `modelpar-data prepare`") from None


def max_token_id(tokens: np.ndarray) -> int:
    """Largest id in ``tokens: [n]`` (``n >= 1``), scanned in chunks so a memory map is never read whole."""
    return max(int(tokens[i : i + _SCAN_CHUNK].max()) for i in range(0, len(tokens), _SCAN_CHUNK))


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True, eq=False)
class TokenFile:
    """A validated token file, read as windows of ``seq_len + 1`` tokens; window ``i`` starts at ``i * seq_len``,
    so consecutive windows share one token (the last target of one is the first input of the next).

    Build with :meth:`open`. ``tokens: [n_tokens]`` is the read-only memory map.
    """

    path: Path
    tokens: np.ndarray = field(repr=False)
    vocab_size: int
    seq_len: int

    @classmethod
    def open(cls, path: str | Path, vocab_size: int, seq_len: int) -> TokenFile:
        """Map ``path`` and check it fits a model with ``vocab_size`` ids and windows of ``seq_len``.

        Raises :class:`DataError` naming the problem: missing file, not a ``.npy``, wrong dtype, not 1-D,
        an id >= ``vocab_size``, or fewer than ``seq_len + 1`` tokens.
        """
        _positive_int("vocab_size", vocab_size)
        _positive_int("seq_len", seq_len)
        path = Path(path)
        tokens = open_tokens(path)
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{path} has {len(tokens)} tokens but one window of seq_len={seq_len} needs {seq_len + 1}; "
                "use a shorter seq_len or more text"
            )
        # A dtype that cannot hold an id >= vocab_size needs no scan (e.g. uint16 under a 65536+ vocabulary).
        if np.iinfo(tokens.dtype).max >= vocab_size:
            top = max_token_id(tokens)
            if top >= vocab_size:
                raise DataError(
                    f"{path} contains token id {top} but vocab_size is {vocab_size}; tokenise it with the "
                    f"model's tokenizer or raise vocab_size to at least {top + 1}"
                )
        return cls(path=path, tokens=tokens, vocab_size=vocab_size, seq_len=seq_len)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_windows(self) -> int:
        """Number of whole windows; the tail shorter than one window is never read."""
        return (len(self.tokens) - 1) // self.seq_len

    def __len__(self) -> int:
        return self.num_windows

    def window(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window ``i`` as ``(inputs: [seq_len], targets: [seq_len])``, int64, targets shifted by one."""
        inputs, targets = self.batch([i])
        return inputs[0], targets[0]

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``indices: [n]`` as ``(inputs: [n, seq_len], targets: [n, seq_len])``, int64.

        One fancy-index gather into the memory map reads only the pages of the requested windows.
        """
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        bad = indices[(indices < 0) | (indices >= self.num_windows)]
        if len(bad):
            raise IndexError(f"window {int(bad[0])} is outside 0..{self.num_windows - 1} of {self.path}")
        offsets = indices[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        windows = torch.from_numpy(self.tokens[offsets].astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
