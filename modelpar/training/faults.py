"""Deliberate faults, for testing that failures are caught and named (chaos testing of a real job).

Set ``MODELPAR_FAULTS`` to a comma-separated list of ``KIND@RANK:STEP[:ARG]`` before launching:

    sleep@1:3        rank 1 hangs forever in its first forward of step 3 (the others must time out)
    kill@2:4         rank 2 SIGKILLs itself in its first forward of step 4
    delay@1:0:0.05   rank 1 sleeps 0.05 s in every forward from step 0 on (a straggler)
    nan@0:3          rank 0's loss is NaN in step 3 (every rank then sees a non-finite loss)
    perturb@1:2      rank 1 adds noise to one parameter after step 2 (replica drift)
    save_crash@0:4   rank 0 dies while writing the checkpoint of step 4

Steps count from 0 (the first step run). Nothing here runs unless the variable is set.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV = "MODELPAR_FAULTS"
KINDS = ("sleep", "kill", "delay", "nan", "perturb", "save_crash")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    arg: float = 0.0

    def due(self, kind: str, rank: int, step: int) -> bool:
        if self.kind != kind or self.rank != rank:
            return False
        return step >= self.step if kind == "delay" else step == self.step


def parse_faults(text: str | None = None) -> tuple[Fault, ...]:
    text = os.environ.get(ENV, "") if text is None else text
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            kind, where = item.split("@")
            parts = where.split(":")
            fault = Fault(kind, int(parts[0]), int(parts[1]), float(parts[2]) if len(parts) > 2 else 0.0)
        except (ValueError, IndexError):
            raise ValueError(f"{ENV}: cannot parse {item!r}; expected KIND@RANK:STEP[:ARG]") from None
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r}; choose one of {', '.join(KINDS)}")
        faults.append(fault)
    return tuple(faults)


def fire(faults: tuple[Fault, ...], kind: str, rank: int, step: int) -> Fault | None:
    """Run the fault of ``kind`` due now (sleep, kill and delay act here); return it, or None."""
    for fault in faults:
        if fault.due(kind, rank, step):
            if kind == "sleep":
                while True:
                    time.sleep(3600)
            if kind in ("kill", "save_crash"):
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "delay":
                time.sleep(fault.arg)
            return fault
    return None
