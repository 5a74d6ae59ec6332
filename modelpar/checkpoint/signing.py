"""Signed checkpoints: an HMAC-SHA256 of ``index.json`` in ``index.sig``, with a key only the job's owner holds.

The index lists every file's SHA-256, so signing the index covers every byte of the checkpoint: a rewritten
file needs a rewritten index, and a rewritten index needs the key. HMAC (standard library) rather than an
ed25519 signature: no new dependency, and the readers of a training checkpoint (resume, eval, export) are the
same people who write it, so they can hold the one key; ed25519 would matter when readers must not be able to
sign, which is not this workload. The key is 32 random bytes, hex, in a file readable by its owner only
(``modelpar-ckpt keygen``); ``trainer.signing_key`` or ``MODELPAR_SIGNING_KEY`` names the file, which is
refused when its group or other users may read it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from modelpar.checkpoint.store import INDEX, CheckpointError, read_index
from modelpar.parallel.secret_file import SecretFileError, check_private

SIGNATURE = "index.sig"
KEY_ENV = "MODELPAR_SIGNING_KEY"


def keygen(path: str | Path) -> Path:
    """Write a new key to ``path`` (mode 0600); refuses to overwrite an existing file."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # raises if it exists
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def load_key(path: str | Path | None = None) -> bytes | None:
    """The key in ``path``, else in the file ``MODELPAR_SIGNING_KEY`` names, else None (signing off)."""
    path = path or os.environ.get(KEY_ENV) or None
    if path is None:
        return None
    try:
        check_private(path, "the signing key")
        text = Path(path).read_text().strip()
        key = bytes.fromhex(text)
    except SecretFileError as exc:
        raise CheckpointError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot read the signing key {path} ({type(exc).__name__}); write one with `modelpar-ckpt keygen FILE`"
        ) from None
    if len(key) < 16:
        raise CheckpointError(f"the signing key {path} is too short ({len(key)} bytes); use `modelpar-ckpt keygen`")
    return key


def signature_of(data: bytes, key: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def sign_file(path: Path, key: bytes, signature: Path) -> None:
    """Write the HMAC of ``path``'s bytes to ``signature``."""
    signature.write_text(signature_of(path.read_bytes(), key) + "\n")


def check_file(path: Path, key: bytes, signature: Path) -> None:
    """Raise ``CheckpointError`` (one line naming the file) unless ``signature`` holds ``path``'s HMAC."""
    if not signature.exists():
        raise CheckpointError(f"{signature} is missing: {path} is unsigned and a signing key is configured")
    want = signature.read_text().strip()
    if not hmac.compare_digest(want, signature_of(path.read_bytes(), key)):
        raise CheckpointError(
            f"{signature} does not match {path}: the checkpoint was modified or signed with another key"
        )


def sign_checkpoint(ckpt: str | Path, key: bytes) -> Path:
    """Sign a checkpoint's index (the caller checks its files against it first)."""
    ckpt = Path(ckpt)
    sign_file(ckpt / INDEX, key, ckpt / SIGNATURE)
    return ckpt / SIGNATURE


def check_checkpoint(ckpt: str | Path, key: bytes) -> None:
    """The checkpoint's index is signed with ``key`` (its files are then checked against the index's hashes)."""
    ckpt = Path(ckpt)
    check_file(ckpt / INDEX, key, ckpt / SIGNATURE)


def read_signed_index(ckpt: str | Path, key: bytes | None, verify: bool = True) -> dict:
    """``read_index`` after checking the signature when a key is configured (``key`` None: hashes only)."""
    if key is not None:
        check_checkpoint(ckpt, key)
    return read_index(ckpt, verify=verify)
