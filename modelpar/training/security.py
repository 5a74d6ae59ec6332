"""Verdicts a person can act on: the security events of a run, each one line naming who and what, kept in
``<run>/security.jsonl`` (time, event, rank, host, the line).

Events: ``refused-worker`` (admission refused a rank), ``code-version`` (a rank runs other code or another
recipe), ``tampered-checkpoint`` (a hash or signature that does not match), ``changed-data`` (resuming on data
the checkpoint was not trained on), ``poisoned-replica`` (a dp replica's gradient disagrees with the others').
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import socket
from dataclasses import asdict
from pathlib import Path

from modelpar.checkpoint.store import CheckpointError
from modelpar.data import DataError
from modelpar.parallel.admission import SECRET_ENV, AdmissionError, AdmissionSpec, AdmissionTimeout
from modelpar.parallel.redact import redact
from modelpar.training.config import TrainConfig

LOG = "security.jsonl"
EVENTS = {  # the exception a verdict arrives as -> its event
    "AdmissionError": None,  # its own: refused-worker or code-version
    "CheckpointError": "tampered-checkpoint",
    "DataError": "changed-data",
}
# one-line verdicts a rank raises under torchrun/SLURM (a rank that never answered the admission is no event)
VERDICTS = (AdmissionError, AdmissionTimeout, CheckpointError, DataError)
_RANK = re.compile(r"\brank (\d+)")


def admission_spec(cfg: TrainConfig, multi_node: bool) -> AdmissionSpec | None:
    """What every rank proves before the job starts: with a job secret, the secret; under torchrun or SLURM
    (``multi_node``), at least the code version and recipe. None: no admission (a local run without a secret).
    The secret's file is read here once, so a missing or readable-by-others file is one line before any rank starts."""
    spec = AdmissionSpec(cfg.trainer.job_secret, recipe=recipe_hash(cfg))
    secret = spec.secret()
    return spec if secret is not None or multi_node else None


def recipe_hash(cfg: TrainConfig) -> str:
    """SHA-256 (16 hex digits) of the recipe, leaving out what may differ between the nodes of one job (file
    paths, the run directory)."""
    recipe = asdict(cfg)
    for section in recipe.values():
        for key in [k for k in section if k.endswith(("path", "dir", "secret", "signing_key"))]:
            section.pop(key)
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record(out_dir: str | Path, event: str, rank: int | None, line: str) -> None:
    """Append one event to ``<out_dir>/security.jsonl`` (its text redacted of any secret); the rank is the first
    the line names, else ``rank``."""
    named = _RANK.search(line)
    entry = {
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
        "event": event,
        "rank": int(named.group(1)) if named else rank,
        "host": socket.gethostname(),
        "line": redact(line, (os.environ.get(SECRET_ENV, ""),)),
    }
    path = Path(out_dir) / LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log:
        log.write(json.dumps(entry) + "\n")


def record_verdict(out_dir: str | Path, exc: BaseException, rank: int | None) -> bool:
    """Record ``exc`` if it is a security verdict (a rank's own, or one a launcher reports as
    ``"halted: <Error>: <line>"``); returns whether it was one."""
    name, line = type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    reported = re.match(r"(?:halted: |rank \d+ failed: )?(\w+): (.*)", line)
    if name == "LaunchError" and reported:
        name, line = reported.groups()
    if name not in EVENTS:
        return False
    event = exc.event if isinstance(exc, AdmissionError) else EVENTS[name]
    if event is None:  # an admission verdict relayed by the launcher
        event = "code-version" if " runs " in line and " but the job runs " in line else "refused-worker"
    record(out_dir, event, rank, line)
    return True


__all__ = ["LOG", "VERDICTS", "admission_spec", "recipe_hash", "record", "record_verdict"]
