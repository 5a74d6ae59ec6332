"""Secrets never reach a file a run writes: text bound for the run directory passes through ``redact`` first.

The secrets known to a process are the values of its environment variables whose names say they hold one
(``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``: ``WANDB_API_KEY``, ``HF_TOKEN``...) and
the contents of the secret files the environment names (the job secret, the checkpoint signing key).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)
SECRET_FILES = ("MODELPAR_JOB_SECRET", "MODELPAR_SIGNING_KEY")  # name files whose contents are secrets
MIN_LENGTH = 8  # shorter values ("1", "true") would blank out ordinary text
MASK = "[redacted]"


def secret_values(extra_files: tuple[str, ...] = ()) -> list[str]:
    """Every secret this process knows of (see the module's docstring), longest first."""
    values = {v for k, v in os.environ.items() if SECRET_NAME.search(k) and k not in SECRET_FILES}
    for path in [os.environ.get(name, "") for name in SECRET_FILES] + list(extra_files):
        if not path:
            continue
        try:
            values.add(Path(path).read_text().strip())
        except OSError:
            continue
    return sorted((v for v in values if len(v) >= MIN_LENGTH), key=len, reverse=True)


def redact(text: str, extra_files: tuple[str, ...] = ()) -> str:
    """``text`` with every known secret replaced by ``[redacted]``."""
    for value in secret_values(extra_files):
        text = text.replace(value, MASK)
    return text


__all__ = ["redact", "secret_values"]
