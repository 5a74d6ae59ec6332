"""Ctrl-C: every rank stops after the same step, the run is saved there, and the launcher says so in one line.

    with StopOnInterrupt() as interrupt:     # the launching process: a first Ctrl-C asks, a second one stops at once
        launch(...)
    interrupt.requested                        # whether the job was asked to stop

    stop = StopRequest.install()             # each rank, around its loop
    if stop.after(step): save; break          # True on every rank after the same step

A terminal's Ctrl-C reaches the launcher and every local rank at once (one process group); a ``kill -INT`` of the
launcher alone is passed on to its ranks. Ranks see the signal at different moments, in different steps, and a
save is collective, so they agree on the step to stop after through the job's rendezvous store: the first rank
to see the signal at the end of its step ``s`` proposes ``s + 2`` (``compare_set``: the first proposal wins).
Each step's collectives (pipeline sends, tp, dp and gradient-norm reductions) chain every rank to the others, so
no rank runs a step ahead of the proposer's next one, and every rank reads the proposal before it finishes step
``s + 2``: all stop after that step. Reading the store is a local file read (a TCP round trip
under torchrun) per step, no device sync.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys

import torch.distributed as dist

STOP_KEY = "modelpar/stop_after_step"


class StopOnInterrupt:
    """In the launching process: the first SIGINT is recorded and passed on to the local ranks (which stop after
    an agreed step and save); a second one raises ``KeyboardInterrupt`` (the ranks are torn down unsaved)."""

    def __init__(self, say=None):
        self.requested = False
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say("modelpar-train: interrupted: every rank stops after this step and saves it (Ctrl-C again: stop now)")
        for child in mp.active_children():
            try:
                os.kill(child.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def __enter__(self) -> StopOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


class StopRequest:
    """On a rank: SIGINT sets a flag instead of raising; ``after(step)`` says whether to stop after ``step``."""

    def __init__(self):
        self.signalled = False
        self.proposed = False
        self.stop_step: int | None = None
        self._previous = None

    @classmethod
    def install(cls) -> StopRequest:
        request = cls()
        request._previous = signal.signal(signal.SIGINT, request._handle)
        return request

    def _handle(self, signum, frame) -> None:
        self.signalled = True

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def after(self, step: int) -> bool:
        """Collective in effect (every rank calls it once per step): True on every rank after the same step."""
        if self.stop_step is None:
            store = _store()
            if store is None:  # one process, no job: stop at once
                return self.signalled
            if self.signalled and not self.proposed:
                store.compare_set(STOP_KEY, "", str(step + 2))
                self.proposed = True
            if store.check([STOP_KEY]):
                self.stop_step = int(store.get(STOP_KEY))
        return self.stop_step is not None and step >= self.stop_step


def _store():
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    # the default group's rendezvous store (torch keeps it private; it is the one every rank shares)
    return dist.distributed_c10d._get_default_store()
