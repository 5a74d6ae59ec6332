"""Restarts without a person: a locally spawned job that fails (a rank died, hung or froze, or a health check
halted it) is torn down and started again from the newest verified checkpoint, up to ``trainer.max_restarts``
times, waiting ``trainer.restart_backoff_s`` (doubling per restart, at most a minute) in between.

Under torchrun or SLURM this process is one rank of a job someone else launched: the launcher's own policy
(``torchrun --max-restarts N``) restarts the workers there, and ``trainer.resume=auto`` makes each new worker
resume from the newest verified checkpoint in the same way.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from modelpar.parallel.launch import LaunchError

MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0
    backoff_s: float = 1.0

    def delay(self, restart: int) -> float:
        """Seconds to wait before restart number ``restart`` (1-based)."""
        return min(self.backoff_s * 2 ** (restart - 1), MAX_BACKOFF_S)


def first_line(exc: LaunchError) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def cause_of(exc: LaunchError, width: int = 160) -> str:
    """One line naming why the job failed: its first line, except where a rank failed by timing out on a hung
    peer: then the flight report's line naming the hung rank comes first (the first line names only a victim)."""
    first = first_line(exc)
    if not re.match(r"rank \d+ failed: ", first):
        return first
    stuck = next(
        (line.strip() for line in str(exc).splitlines()[1:] if re.match(r"\s*rank \d+ .*stuck in ", line)), None
    )
    if stuck is None:
        return first
    return f"{stuck}; {first if len(first) <= width else first[: width - 3] + '...'}"


def run_with_restarts(
    attempt: Callable[[int], None],
    policy: RestartPolicy,
    log_path: Path,
    say: Callable[[str], None] = print,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Call ``attempt(n)`` for n = 0, 1, ... until it returns; after a ``LaunchError`` start again while
    restarts are left (one line each, naming the cause; also appended to ``log_path`` as JSON), else re-raise.
    Returns how many restarts it took."""
    for restart in range(policy.max_restarts + 1):
        try:
            attempt(restart)
            return restart
        except LaunchError as exc:
            if restart == policy.max_restarts:
                raise
            wait = policy.delay(restart + 1)
            cause = cause_of(exc)
            say(f"modelpar-train: restart {restart + 1} of {policy.max_restarts} in {wait:g} s after: {cause}")
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("a") as log:
                log.write(json.dumps({"restart": restart + 1, "rank": exc.rank, "cause": cause, "wait_s": wait}) + "\n")
            sleep(wait)
    raise AssertionError("unreachable")
