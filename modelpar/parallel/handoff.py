"""Two micro-batches on one rank, each running while the other's collective is in flight.

DualPipeV pairs the forward of one micro-batch with the backward of another on the same rank
(``modelpar.pipeline.schedule_v``): while one waits for its expert all-to-all (or a tensor-parallel
all-reduce: ``collectives.all_reduce``, and the column-parallel backward's), the other computes. ``Pair``
runs the two sides on two host threads that take turns: only the side holding the turn runs, and it hands
the turn over at each ``while_in_flight()``, called right after a collective is posted and before it is
waited on. The other side then runs until its own next posted collective (or its end) and hands back. So

    F: ... post dispatch -> [B runs: ... post combine-gradient -> hand back] -> wait dispatch -> experts ...

Because exactly one side runs at any moment and the hand-over points are fixed by the model's code, every
rank of a group issues its collectives in the same order, as blocking ones would: no new process group and
no tags are needed, and the result is bit for bit that of running the sides one after the other (the same
kernels on the same inputs; only the order in which two independent graphs are worked through changes).
The overlap is the collective's own progress: gloo works on its own threads, NCCL on its own stream.

Thread-local settings the runtime's caller made (grad mode, autocast) are carried into the helper thread.
Autograd runs a CPU backward on the calling thread; on a GPU it may run on its device thread, which is why
the turn belongs to the pair, not to a thread: whoever calls ``while_in_flight`` holds it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

_active: Pair | None = None  # the pair running now, on this process


def while_in_flight() -> None:
    """Let the paired micro-batch run until it posts a collective of its own (no-op outside a pair)."""
    pair = _active
    if pair is not None:
        pair.hand_over()


class Pair:
    """Run ``first`` (on a helper thread) and ``second`` (on this one), first first, taking turns at each
    ``while_in_flight``. ``on_turn(side)`` is told whenever side 0 or 1 takes the turn. ``handovers`` counts
    the turns handed over."""

    def __init__(self, on_turn: Callable[[int], None] = lambda side: None):
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False, False]
        self._on_turn = on_turn
        self.handovers = 0

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        global _active
        if _active is not None:
            raise RuntimeError("a pair is already running on this process; pairs do not nest")
        errors: list[BaseException] = []
        settings = _thread_settings()
        helper = threading.Thread(target=self._side, args=(0, first, errors, settings), name="pair-forward")
        _active = self
        try:
            self._on_turn(0)
            helper.start()
            self._side(1, second, errors, contextlib.nullcontext)
            helper.join()
        finally:
            _active = None
        if errors:
            raise errors[0]

    def hand_over(self) -> None:
        with self._cond:
            me = self._turn
            other = 1 - me
            if self._done[other]:
                return
            self.handovers += 1
            self._give(other)
            self._cond.wait_for(lambda: self._turn == me)

    def _side(self, side: int, fn: Callable[[], None], errors: list, settings) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == side)
        try:
            with settings():
                fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread by ``run``
            errors.append(exc)
        finally:
            with self._cond:
                self._done[side] = True
                if not self._done[1 - side]:
                    self._give(1 - side)

    def _give(self, side: int) -> None:  # under self._cond
        self._turn = side
        self._on_turn(side)
        self._cond.notify_all()


def _thread_settings() -> Callable[[], contextlib.AbstractContextManager]:
    """A context that gives another thread the calling thread's grad mode and autocast."""
    grad = torch.is_grad_enabled()
    casts = [
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    ]

    @contextlib.contextmanager
    def settings():
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            for device, dtype in casts:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield

    return settings
