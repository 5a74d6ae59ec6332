"""Files that hold secrets (the job secret, the checkpoint signing key): read only when nobody else can.

A secret is named by a file, never written on a command line (where ``ps`` and Hydra's saved overrides would
show it). A file whose mode lets its group or other users read it is refused in one line naming the file and
the ``chmod`` that fixes it: a secret others can read is not one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class SecretFileError(RuntimeError):
    """A secret file is missing, unreadable, malformed or readable by others; the message is one line."""

    one_line = True


def check_private(path: str | Path, what: str) -> None:
    """Raise ``SecretFileError`` when ``path`` (``what`` holds a secret) may be read by its group or others."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretFileError(
            f"{what} {path} is readable by others (mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}`"
        )


def read_secret(path: str | Path, what: str, fix: str) -> bytes:
    """The hex secret in ``path`` (at least 16 bytes), once its mode is checked; ``fix`` says how to make one."""
    try:
        check_private(path, what)
        key = bytes.fromhex(Path(path).read_text().strip())
    except (OSError, ValueError) as exc:
        raise SecretFileError(f"cannot read {what} {path} ({type(exc).__name__}); {fix}") from None
    if len(key) < 16:
        raise SecretFileError(f"{what} {path} is too short ({len(key)} bytes); {fix}")
    return key


__all__ = ["SecretFileError", "check_private", "read_secret"]
