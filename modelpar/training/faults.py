"""Deliberate faults, for testing that failures are caught and named (chaos testing of a real job).

Set ``MODELPAR_FAULTS`` to a comma-separated list of ``KIND@RANK:STEP[:ARG]`` before launching:

    sleep@1:3        rank 1 hangs forever in its first forward of step 3 (the others must time out)
    kill@2:4         rank 2 SIGKILLs itself in its first forward of step 4
    lose@3:2         rank 3 dies in step 2 and is declared lost for good (a machine that does not come back):
                     a marker in ``MODELPAR_LOST_RANKS``, so a restart has one rank fewer (``trainer.elastic``)
    delay@1:0:0.05   rank 1 sleeps 0.05 s in every forward from step 0 on (a straggler)
    nan@0:3          rank 0's loss is NaN in step 3 (every rank then sees a non-finite loss)
    perturb@1:2      rank 1 adds noise to one parameter after step 2 (replica drift)
    save_crash@0:4   rank 0 dies while writing the checkpoint of step 4
    save_error@1:4   rank 1's write of the checkpoint of step 4 fails with ENOSPC (disk full)
    bitflip@1:2      one bit of one value in rank 1's activation flips in step 2's first micro-batch (silent
                     corruption, as a failing device would cause; trainer.sdc_check_every catches it)
    grad_scale@2:1:100  rank 2's gradients are scaled by 100 in step 1, before they are reduced (a faulty worker)
    grad_flip@2:1    rank 2's gradients change sign in step 1 (a poisoned worker)

Steps count from 0 (the first step run). Nothing here runs unless the variable is set.

With ``MODELPAR_FAULTS_FIRED`` naming a directory (the launcher sets it when ``trainer.max_restarts`` > 0), each
fault happens once per job, as the event it stands for would: a marker file is written there as it fires, and a
restarted job skips the faults already marked (``delay`` is a condition, not an event, and is never marked).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from modelpar.model.transformer import Block
from modelpar.training.plugins import StepPlugin

ENV = "MODELPAR_FAULTS"
FIRED_ENV = "MODELPAR_FAULTS_FIRED"
LOST_ENV = "MODELPAR_LOST_RANKS"  # the directory a ``lose`` fault marks its rank in (set by the launcher)
KINDS = (
    "sleep",
    "kill",
    "lose",
    "delay",
    "nan",
    "perturb",
    "save_crash",
    "save_error",
    "grad_scale",
    "grad_flip",
    "bitflip",
)


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

    @property
    def marker(self) -> str:
        return f"{self.kind}@{self.rank}:{self.step}"


def _mark_fired(fault: Fault) -> None:
    """Record that ``fault`` happened (before it acts: a kill leaves no time after)."""
    root = os.environ.get(FIRED_ENV)
    if root and fault.kind != "delay":
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, fault.marker), "w"):
            pass


def _not_fired(faults: tuple[Fault, ...]) -> tuple[Fault, ...]:
    root = os.environ.get(FIRED_ENV)
    if not root:
        return faults
    return tuple(f for f in faults if not os.path.exists(os.path.join(root, f.marker)))


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
            _mark_fired(fault)
            if kind == "sleep":
                while True:
                    time.sleep(3600)
            if kind == "lose" and os.environ.get(LOST_ENV):
                os.makedirs(os.environ[LOST_ENV], exist_ok=True)
                with open(os.path.join(os.environ[LOST_ENV], fault.marker), "w"):
                    pass
            if kind in ("kill", "lose", "save_crash"):
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "delay":
                time.sleep(fault.arg)
            return fault
    return None


class FaultHooks(StepPlugin):
    """The faults of ``MODELPAR_FAULTS`` due on this rank, hooked into a trainer from outside: a forward
    pre-hook on each chunk (sleep, kill, lose, delay), a forward hook on the first block (bitflip), the step's
    plug-in points (nan, perturb) and the checkpoint's rank state (save_crash, save_error). ``install``
    registers them only when the variable is set."""

    name = "faults"

    def __init__(self, faults: tuple[Fault, ...], rank: int, params: list):
        self.faults, self.rank, self.params = faults, rank, params
        self.step = 0
        self._flipped_at: int | None = None

    def flip(self, module, args, output):
        """Once per due step (its first micro-batch's forward): one bit of the output's first value flips."""
        if self._flipped_at == self.step or not fire(self.faults, "bitflip", self.rank, self.step):
            return None
        self._flipped_at = self.step
        with torch.no_grad():  # in place: autograd saves nothing more than it would (recompute stays valid)
            flat = output.detach().reshape(-1)
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            flat[:1].view(bits).bitwise_xor_(1 << 3)  # a low mantissa bit: a tiny, silent change
        return None

    def forward(self, module, args) -> None:
        for kind in ("sleep", "kill", "lose", "delay"):
            fire(self.faults, kind, self.rank, self.step)

    def gradient(self, grad):
        for fault in self.faults:
            if fault.rank == self.rank and fault.step == self.step and fault.kind in ("grad_scale", "grad_flip"):
                _mark_fired(fault)
                if fault.kind == "grad_scale":
                    grad = grad * fault.arg
                elif fault.kind == "grad_flip":
                    grad = -grad
        return grad

    def begin(self, step: int) -> None:
        self.step = step  # the forward hooks' step (a resumed run starts past 0)

    def loss(self, step: int, loss):
        self.step = step
        if fire(self.faults, "nan", self.rank, step):
            return loss * float("nan")  # as if this rank's batch were poisoned
        return loss

    def after_update(self, step: int, applied: bool = True) -> None:
        if fire(self.faults, "perturb", self.rank, step):
            with torch.no_grad():
                self.params[0].add_(1e-3)
        self.step = step + 1

    def rank_state(self, step: int, state: Mapping) -> Mapping:
        """``state``, wrapped so that a due save crash kills the rank after its model file is written, and a
        due save error fails its write as a full disk would."""
        due = {f.kind for f in self.faults if f.rank == self.rank and f.step == step}
        if not due & {"save_crash", "save_error"}:
            return state
        faults, rank = self.faults, self.rank
        failing = "save_error" in due
        if failing:
            _mark_fired(next(f for f in faults if f.kind == "save_error" and f.rank == rank and f.step == step))

        class Crashing(Mapping):
            def __getitem__(self, key):
                return state[key]

            def __iter__(self):
                fire(faults, "save_crash", rank, step)
                if failing:
                    raise OSError(errno.ENOSPC, "No space left on device (fault save_error)", "rank state")
                return iter(state)

            def __len__(self):
                return len(state)

            def values(self):  # the save's size estimate reads these; the fault strikes at the write
                return state.values()

        return Crashing()


def install(chunks, rank: int, params: list) -> FaultHooks | None:
    """Hook the faults of ``MODELPAR_FAULTS`` due on this rank into its chunks; None when none is set."""
    faults = _not_fired(parse_faults())
    if not faults:
        return None
    hooks = FaultHooks(faults, rank, params)
    for chunk in chunks:
        chunk.register_forward_pre_hook(hooks.forward)
    if any(f.kind == "bitflip" and f.rank == rank for f in faults):
        first_block = next((m for m in chunks[0].modules() if isinstance(m, Block)), chunks[0])
        first_block.register_forward_hook(hooks.flip)
    if any(f.kind in ("grad_scale", "grad_flip") and f.rank == rank for f in faults):
        for p in params:  # before accumulation, so the overlapped dp buckets carry the poisoned values too
            p.register_hook(hooks.gradient)
    return hooks
