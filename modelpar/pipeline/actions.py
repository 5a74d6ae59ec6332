"""The schedule IR: an ``Action`` is one step of one pipeline rank; a schedule is one ordered list per rank.

String form: ``{rank}{kind}{micro_batch}``, with ``c{chunk}`` appended when the action belongs to a local
chunk other than 0 (interleaved schedules)::

    1F0         rank 1 runs the forward of micro-batch 0 (on its local chunk 0)
    0B3c1       rank 0 runs the backward of micro-batch 3 on its local chunk 1
    2W1         rank 2 computes the weight gradients of micro-batch 1 (zero-bubble schedules)
    1RECV_F0    rank 1 receives the input activation of its forward of micro-batch 0
    0SEND_B2c1  rank 0 sends upstream the input gradient of its backward of micro-batch 2, chunk 1

Local chunk ``c`` of rank ``r`` is model chunk (virtual stage) ``c * pp + r`` (Megatron's interleaving), so
activations flow rank 0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ... and gradients flow back; a schedule may
instead carry the V placement (``modelpar.pipeline.placement``), and every helper here takes it. A run of
consecutive SEND/RECV actions on one rank is a *batch*: the runtime posts it with one ``batch_isend_irecv``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from modelpar.pipeline.placement import Placement

INTERLEAVED = Placement.INTERLEAVED


class ScheduleError(ValueError):
    """An impossible schedule request or a malformed action list; the message is one line with a fix."""


class ActionKind(StrEnum):
    """What a rank does in one step."""

    F = "F"  # forward
    B = "B"  # backward: input and weight gradients, or input gradients only when the schedule has W
    W = "W"  # weight gradients (zero-bubble schedules)
    SEND_F = "SEND_F"  # send a forward output downstream
    RECV_F = "RECV_F"  # receive a forward input from upstream
    SEND_B = "SEND_B"  # send an input gradient upstream
    RECV_B = "RECV_B"  # receive an output gradient from downstream

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.W)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)


F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B

# Longest kinds first so that "SEND_F" is not read as "S" followed by junk.
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)(?:c(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one pipeline rank: ``kind`` of ``micro_batch`` on local ``chunk`` of ``rank``."""

    rank: int
    kind: ActionKind
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        suffix = f"c{self.chunk}" if self.chunk else ""
        return f"{self.rank}{self.kind.value}{self.micro_batch}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("1F0c1") == Action(1, F, 0, chunk=1)``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}; expected {{rank}}{{kind}}{{micro_batch}}[c{{chunk}}], e.g. '1F0' or "
                "'0SEND_B2c1'"
            )
        rank, kind, micro_batch, chunk = match.groups()
        return cls(int(rank), ActionKind(kind), int(micro_batch), int(chunk or 0))

    def stage(self, pp: int, placement: Placement = INTERLEAVED) -> int:
        """Model chunk (virtual stage) this action runs on: ``chunk * pp + rank`` when interleaved."""
        return placement.stage(self.rank, self.chunk, pp)


class Schedule(list):
    """One ordered action list per pipeline rank, and the chunk placement those lists assume.

    ``pairs``: (forward, backward) actions of different micro-batches, adjacent in their rank's list, that
    the runtime may run as one overlapped pair (DualPipeV); empty for the other schedules."""

    def __init__(self, rows=(), placement: Placement = INTERLEAVED, pairs=()):
        super().__init__(rows)
        self.placement = Placement(placement)
        self.pairs: frozenset[tuple[Action, Action]] = frozenset(pairs)


def placement_of(schedule: list[list[Action]]) -> Placement:
    """The placement ``schedule`` was built for; a plain list of rows is interleaved."""
    return schedule.placement if isinstance(schedule, Schedule) else INTERLEAVED


def parse_schedule(rows: list[str] | list[list[str]], placement: Placement = INTERLEAVED) -> Schedule:
    """Parse per-rank lists written as strings (``["0F0 0F1 0B0 0B1", ...]``) or lists of strings."""
    rows = [row.split() if isinstance(row, str) else row for row in rows]
    return Schedule(([Action.parse(a) for a in row] for row in rows), placement)


def format_schedule(schedule: Schedule) -> list[str]:
    """One space-separated line per rank; ``parse_schedule`` reads it back."""
    return [" ".join(str(a) for a in row) for row in schedule]


def peer_of(action: Action, pp: int, placement: Placement = INTERLEAVED) -> tuple[int, int]:
    """``(rank, chunk)`` on the other end of a communication action."""
    step = 1 if action.kind in (SEND_F, RECV_B) else -1
    return placement.locate(action.stage(pp, placement) + step, pp)


def matching_action(action: Action, pp: int, placement: Placement = INTERLEAVED) -> Action:
    """The action on the peer that completes this send or receive."""
    rank, chunk = peer_of(action, pp, placement)
    kind = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}[action.kind]
    return Action(rank, kind, action.micro_batch, chunk)


def comm_batches(actions: list[Action]) -> list[list[Action]]:
    """Split one rank's list into runs: each compute action alone, consecutive comm actions together."""
    batches: list[list[Action]] = []
    for a in actions:
        if not a.kind.is_compute and batches and not batches[-1][0].kind.is_compute:
            batches[-1].append(a)
        else:
            batches.append([a])
    return batches


def upstream_compute(action: Action, pp: int, last_stage: int, placement: Placement = INTERLEAVED) -> Action | None:
    """The compute action whose output ``action`` consumes: F of the previous model chunk for F, B of the next
    one for B (None for W, for F on model chunk 0 and for B on the last)."""
    stage = action.stage(pp, placement)
    if action.kind is F and stage > 0:
        rank, chunk = placement.locate(stage - 1, pp)
        return Action(rank, F, action.micro_batch, chunk)
    if action.kind is B and stage < last_stage:
        rank, chunk = placement.locate(stage + 1, pp)
        return Action(rank, B, action.micro_batch, chunk)
    return None


def input_recv(action: Action, pp: int, last_stage: int, placement: Placement = INTERLEAVED) -> Action | None:
    """The RECV whose data ``action`` consumes (None for W, for F on chunk 0 and B on the last chunk, and where
    the data comes from the same rank: under the V placement the forward turns around on rank pp-1 from one
    local chunk to the other, and so does the backward, without a p2p hop)."""
    source = upstream_compute(action, pp, last_stage, placement)
    if source is None or source.rank == action.rank:
        return None
    kind = RECV_F if action.kind is F else RECV_B
    return Action(action.rank, kind, action.micro_batch, action.chunk)
