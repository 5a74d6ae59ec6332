"""The torch releases the engine is tested on, checked before any rank starts.

The ZeRO-2/3 path ends a split backward through private FSDP2 calls (``modelpar/optim/fsdp.py``), and the
context-parallel attention uses a private aten op; both are checked against the releases in
``TESTED_TORCH`` (what ``pyproject.toml`` requires, and the CPU pin in ``constraints/cpu.txt``). Another torch is
refused in one line; ``MODELPAR_ALLOW_UNTESTED_TORCH=1`` runs it anyway.
"""

from __future__ import annotations

import os

import torch

TESTED_TORCH = ((2, 13), (2, 14))  # [first, last): the minor releases this engine is tested on
ALLOW_ENV = "MODELPAR_ALLOW_UNTESTED_TORCH"


class UntestedTorchError(RuntimeError):
    """This torch is outside ``TESTED_TORCH``; the message says how to proceed."""


def torch_minor(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch_version(version: str | None = None, environ: dict | None = None) -> None:
    """Raise ``UntestedTorchError`` (one line) unless ``version`` (this torch's) is in ``TESTED_TORCH`` or the
    override is set."""
    version = version or torch.__version__
    first, last = TESTED_TORCH
    if first <= torch_minor(version) < last or (environ if environ is not None else os.environ).get(ALLOW_ENV) == "1":
        return
    raise UntestedTorchError(
        f"torch {version} is untested (modelpar is tested on torch >={first[0]}.{first[1]},<{last[0]}.{last[1]}; "
        f"ZeRO-2/3 relies on FSDP2 internals); install a tested torch or set {ALLOW_ENV}=1 to run anyway"
    )
