"""The run directory belongs to one job, and that job can write it.

    check_writable(run_dir)          # RunDirError, one line, before Hydra makes it
    lock = RunLock.acquire(run_dir)  # RunDirError naming the holder's pid and host; released at exit

Two jobs writing one directory interleave their metrics and overwrite each other's checkpoints; the second
learns of it only at its first save. The lock is an ``flock`` on ``<run>/.lock``: the kernel drops it when the
holding process ends however it ends, so a lock file left by a dead job is simply taken over (the pid and host
written in it are only for the message), and two jobs starting at once cannot both take it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

LOCK_NAME = ".lock"


class RunDirError(ValueError):
    """The run directory cannot be this job's; the message is one line naming why and the fix."""


def check_writable(run_dir: str | Path) -> None:
    """Make ``run_dir`` (and its parents) and write a file in it, or raise ``RunDirError`` in one line."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise RunDirError(
            f"cannot write the run directory {path} ({reason}); choose a writable one with hydra.run.dir=PATH"
        ) from None


def run_dir_of(argv: list[str], default: str = "runs") -> str | None:
    """The run directory a command line gives Hydra (``hydra.run.dir=...``, up to its first interpolation), the
    recipe's ``default`` parent otherwise; None for a multirun (``-m``), whose directories Hydra names per job."""
    if "-m" in argv or "--multirun" in argv:
        return None
    given = [arg.split("=", 1)[1] for arg in argv if arg.lstrip("+").startswith("hydra.run.dir=")]
    if not given:
        return default
    fixed = given[-1].split("$", 1)[0]
    return fixed if "$" not in given[-1] else (str(Path(fixed).parent) if not fixed.endswith("/") else fixed) or "."


class RunLock:
    """An exclusive lock on a run directory, held by this process until ``release()`` or its exit."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunLock:
        path = Path(run_dir) / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirError(
                f"{run_dir} is in use by another training job (pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')}, since {holder.get('since', '?')}); wait for it or stop it, or use "
                "another hydra.run.dir"
            ) from None
        os.ftruncate(fd, 0)  # a dead holder's record, if any, is replaced by this job's
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        return cls(path, fd)

    def __del__(self) -> None:  # a multirun's jobs each lock their own directory in one process
        self.release()

    def release(self) -> None:
        if self.fd < 0:
            return
        os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing the descriptor drops the flock
        self.fd = -1


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}  # the holder has opened the file but not yet written its record
