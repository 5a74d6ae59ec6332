"""Simulate a schedule: when every action runs, the bubble, peak activations, and proof it cannot deadlock.

The model is the runtime's, made strict enough for NCCL:

* a rank runs its list in order; a compute action takes its cost and starts when the rank is free and the
  data it consumes has arrived; sends do not hold up compute;
* a batch of consecutive SEND/RECV actions is one group on the rank's single p2p stream: batches run one
  after another, and a batch ends only when every op in it has met its peer op (a send may not finish
  before its receive is posted, as with NCCL); a compute action that needs a receive waits for its whole
  batch;
* the k-th send from rank a to rank b must be the k-th receive on b from a, because NCCL matches p2p in
  order and ignores tags.

A schedule that passes under these rules also runs under looser ones (gloo's buffered sends).

If no rank can take a step, the schedule would hang the real job: ``ScheduleDeadlock`` says so with a
step x rank table.

Peak in-flight activations count, on each rank, the (micro-batch, chunk) pairs whose F has run and whose
backward has not finished: B for schedules without W, and W for zero-bubble schedules, because the runtime
keeps a micro-batch's autograd graph (so its saved activations) until the weight gradients are taken.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from modelpar.pipeline.actions import (
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    comm_batches,
    input_recv,
    matching_action,
    peer_of,
    placement_of,
    upstream_compute,
)


class ScheduleDeadlock(ScheduleError):
    """No rank can progress; the message carries a step x rank table with the stuck steps marked."""


@dataclass(frozen=True)
class Costs:
    """Durations of compute actions (any time unit) and the latency of one p2p transfer.

    ``backward`` is an unsplit backward (input and weight gradients); schedules with W actions use
    ``backward_input`` for B and ``backward_weight`` for W instead. ``per_action`` overrides the duration of
    individual actions, e.g. to replay the durations a runtime measured.
    """

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0
    per_action: Mapping[Action, float] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, durations: Mapping[str, float]) -> Costs:
        """Read ``{"F": .., "B": .., "W": .., "latency": ..}``; B sets both the split and unsplit backward."""
        unknown = set(durations) - {"F", "B", "W", "latency"}
        if unknown:
            raise ValueError(f"unknown duration keys {sorted(unknown)}; use F, B, W and latency")
        return cls(
            forward=durations.get("F", cls.forward),
            backward=durations.get("B", cls.backward),
            backward_input=durations.get("B", cls.backward_input),
            backward_weight=durations.get("W", cls.backward_weight),
            latency=durations.get("latency", cls.latency),
        )

    def duration(self, action: Action, split_backward: bool) -> float:
        if action in self.per_action:
            return self.per_action[action]
        if action.kind is F:
            return self.forward
        if action.kind is B:
            return self.backward_input if split_backward else self.backward
        if action.kind is W:
            return self.backward_weight
        return 0.0


@dataclass(frozen=True)
class TimedAction:
    """An action with its start and end time (simulated or measured)."""

    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Timed actions per rank, compute and communication; simulated or measured by the runtime."""

    rows: tuple[tuple[TimedAction, ...], ...]

    @property
    def start(self) -> float:
        return min(t.start for row in self.rows for t in row)

    @property
    def end(self) -> float:
        return max(t.end for row in self.rows for t in row)

    @property
    def span(self) -> float:
        """Time from the first action on any rank to the last one."""
        return self.end - self.start

    def compute_time(self, rank: int) -> float:
        """Time the rank computes: the union of its compute intervals (a DualPipeV pair's two overlap)."""
        total, reach = 0.0, float("-inf")
        for t in sorted((t for t in self.rows[rank] if t.action.kind.is_compute), key=lambda t: t.start):
            if t.end > reach:
                total += t.end - max(t.start, reach)
                reach = t.end
        return total

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time over ``ranks x span``; time spent communicating counts as idle."""
        total = len(self.rows) * self.span
        return 1.0 - sum(self.compute_time(r) for r in range(len(self.rows))) / total if total > 0 else 0.0


@dataclass(frozen=True)
class Simulation:
    """What ``simulate`` predicts for a schedule."""

    timeline: Timeline
    peak_in_flight: tuple[int, ...]  # per rank, in (micro-batch, chunk) units

    @property
    def makespan(self) -> float:
        return self.timeline.end

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction


def simulate(schedule: Schedule, costs: Costs | Mapping[str, float] | None = None) -> Simulation:
    """Time every action of ``schedule`` (one list per rank, with SEND/RECV actions) under ``costs``.

    Each rank has a compute lane and a communication lane. The compute lane runs the list in order; on
    reaching a batch of SEND/RECV it hands the batch to the communication lane and moves on, and a compute
    action waits for the batch holding the receive it consumes. The communication lane posts batches in
    order and finishes one when every op in it has met its peer op, at the latest ``max(post times) +
    latency`` over its ops; every op of the batch ends then.

    Raises ``ScheduleError`` for a malformed schedule (a missing or repeated action, a SEND before its
    compute, unmatched or misordered p2p) and ``ScheduleDeadlock`` if the ranks would hang.
    """
    costs = _as_costs(costs)
    pp = len(schedule)
    place = placement_of(schedule)
    _check_actions(schedule, pp, with_comm=True)
    _check_p2p_order(schedule, pp)
    split = any(a.kind is W for row in schedule for a in row)
    last_stage = _last_stage(schedule, pp)
    batches = [comm_batches(row) for row in schedule]
    compute_at = [0] * pp  # next batch the compute lane reaches
    compute_clock = [0.0] * pp
    lane: list[list[tuple[list[Action], float]]] = [[] for _ in range(pp)]  # (batch, time handed over)
    lane_at = [0] * pp
    lane_clock = [0.0] * pp
    posted: dict[Action, float] = {}
    timed: dict[Action, TimedAction] = {}
    while any(compute_at[r] < len(batches[r]) or lane_at[r] < len(lane[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while compute_at[r] < len(batches[r]):
                batch = batches[r][compute_at[r]]
                recv = input_recv(batch[0], pp, last_stage, place)
                if not batch[0].kind.is_compute:
                    lane[r].append((batch, compute_clock[r]))
                elif recv is None or recv in timed:
                    start = max(compute_clock[r], timed[recv].end if recv else 0.0)
                    compute_clock[r] = start + costs.duration(batch[0], split)
                    timed[batch[0]] = TimedAction(batch[0], start, compute_clock[r])
                else:
                    break
                compute_at[r] += 1
                progressed = True
            while lane_at[r] < len(lane[r]):
                batch, handed = lane[r][lane_at[r]]
                for op in batch:
                    posted.setdefault(op, max(handed, lane_clock[r]))
                peers = [matching_action(op, pp, place) for op in batch]
                if not all(p in posted for p in peers):
                    break
                lane_clock[r] = max(
                    max(posted[op], posted[p]) + costs.latency for op, p in zip(batch, peers, strict=True)
                )
                for op in batch:
                    timed[op] = TimedAction(op, posted[op], lane_clock[r])
                lane_at[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleDeadlock(_report(schedule, _stuck(batches, compute_at, lane, lane_at, posted, pp, place)))
    timeline = Timeline(tuple(tuple(timed[a] for a in row) for row in schedule))
    return Simulation(timeline, tuple(peak_in_flight(row) for row in schedule))


def _stuck(
    batches: list[list[list[Action]]],
    compute_at: list[int],
    lane: list[list[tuple[list[Action], float]]],
    lane_at: list[int],
    posted: dict[Action, float],
    pp: int,
    place,
) -> dict[int, tuple[list[Action], str]]:
    """Per stuck rank: the actions it is stuck on and what each waits for."""
    stuck = {}
    for r in range(pp):
        marked, why = [], []
        if lane_at[r] < len(lane[r]):
            batch = lane[r][lane_at[r]][0]
            peers = [matching_action(op, pp, place) for op in batch]
            missing = [str(p) for p in peers if p not in posted]
            marked += batch
            why.append(f"{' '.join(map(str, batch))} waits for {' '.join(missing)}")
        if compute_at[r] < len(batches[r]) and batches[r][compute_at[r]][0].kind.is_compute:
            action = batches[r][compute_at[r]][0]
            marked.append(action)
            why.append(f"{action} waits for its input")
        if marked:
            stuck[r] = (marked, "; ".join(why))
    return stuck


def compute_timeline(schedule: Schedule, costs: Costs | Mapping[str, float] | None = None) -> Timeline:
    """Time only the compute actions, with direct dependencies and no communication lane.

    F of micro-batch j on model chunk g starts after F j on chunk g-1 has ended plus ``latency``; B after B
    on chunk g+1 (plus latency) and after its own F; W after its own B. The ideal any placement of
    SEND/RECV actions can reach; ``p2p_order`` uses it to order transfers.
    """
    costs = _as_costs(costs)
    place = placement_of(schedule)
    compute = Schedule(([a for a in row if a.kind.is_compute] for row in schedule), place)
    pp = len(compute)
    _check_actions(compute, pp, with_comm=False)
    split = any(a.kind is W for row in compute for a in row)
    last_stage = _last_stage(compute, pp)
    at = [0] * pp
    clock = [0.0] * pp
    timed: dict[Action, TimedAction] = {}
    while any(at[r] < len(compute[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while at[r] < len(compute[r]):
                action = compute[r][at[r]]
                source = upstream_compute(action, pp, last_stage, place)
                if source is not None and source not in timed:
                    break
                local = source is None or source.rank == r  # the V turnaround needs no transfer
                ready = 0.0 if source is None else timed[source].end + (0.0 if local else costs.latency)
                start = max(clock[r], ready)
                clock[r] = start + costs.duration(action, split)
                timed[action] = TimedAction(action, start, clock[r])
                at[r] += 1
                progressed = True
        if not progressed:
            stuck = {
                r: ([compute[r][at[r]]], f"waiting for {upstream_compute(compute[r][at[r]], pp, last_stage, place)}")
                for r in range(pp)
                if at[r] < len(compute[r])
            }
            raise ScheduleDeadlock(_report(compute, stuck))
    return Timeline(tuple(tuple(timed[a] for a in row) for row in compute))


def check_schedule(schedule: Schedule) -> Simulation:
    """Raise if ``schedule`` is malformed or can deadlock; return its unit-cost simulation otherwise."""
    return simulate(schedule)


def peak_in_flight(actions: list[Action]) -> int:
    """Most (micro-batch, chunk) activations held at once by one rank running ``actions`` in order."""
    frees_at = W if any(a.kind is W for a in actions) else B
    held = peak = 0
    for a in actions:
        if a.kind is F:
            held += 1
            peak = max(peak, held)
        elif a.kind is frees_at:
            held -= 1
    return peak


def _as_costs(costs: Costs | Mapping[str, float] | None) -> Costs:
    return Costs() if costs is None else costs if isinstance(costs, Costs) else Costs.from_mapping(costs)


def _last_stage(schedule: Schedule, pp: int) -> int:
    return pp * (1 + max((a.chunk for row in schedule for a in row), default=0)) - 1


# -- validation --------------------------------------------------------------------------------------------


def _check_actions(schedule: Schedule, pp: int, *, with_comm: bool) -> None:
    """Every rank runs F and B (and W for all or none) once per (micro-batch, chunk), each after its inputs;
    a schedule without any B is forward-only (evaluation) and needs only the F."""
    place = placement_of(schedule)
    m = 1 + max((a.micro_batch for row in schedule for a in row), default=-1)
    vpp = 1 + max((a.chunk for row in schedule for a in row), default=-1)
    split = any(a.kind is W for row in schedule for a in row)
    backward = split or any(a.kind is B for row in schedule for a in row)
    last_stage = pp * vpp - 1
    for r, row in enumerate(schedule):
        seen: set[Action] = set()
        for i, a in enumerate(row):
            if a.rank != r:
                raise ScheduleError(f"step {i} of rank {r} is {a}, an action of rank {a.rank}")
            if a in seen:
                raise ScheduleError(f"{a} appears twice in rank {r}'s list (second time at step {i})")
            if not a.kind.is_compute and peer_of(a, pp, place)[0] == r:
                raise ScheduleError(f"{a} at step {i} of rank {r} sends to its own rank; the data stays local, drop it")
            for need in _needed_before(a, pp, last_stage, place, with_comm):
                if need not in seen:
                    raise ScheduleError(f"{a} at step {i} of rank {r} comes before {need}; move it after")
            seen.add(a)
        kinds = (F, B, W) if split else (F, B) if backward else (F,)
        for kind in kinds:
            for chunk in range(vpp):
                missing = [j for j in range(m) if Action(r, kind, j, chunk) not in seen]
                if missing:
                    first = Action(r, kind, missing[0], chunk)
                    raise ScheduleError(f"rank {r} never runs {first} ({len(missing)} {kind.value} actions missing)")


def _needed_before(a: Action, pp: int, last_stage: int, place, with_comm: bool) -> list[Action]:
    """Actions of the same rank that must come before ``a``: its receive (or, where the data stays on the
    rank, the compute producing it), its own F for B, its B for W and for a SEND_B, its F for a SEND_F."""
    need = []
    if a.kind in (F, B):
        source = upstream_compute(a, pp, last_stage, place)
        recv = input_recv(a, pp, last_stage, place)
        if recv is not None and with_comm:
            need.append(recv)
        elif source is not None and source.rank == a.rank:
            need.append(source)
    own = {B: F, W: B, SEND_F: F, SEND_B: B}.get(a.kind)
    if own is not None:
        need.append(Action(a.rank, own, a.micro_batch, a.chunk))
    return need


def _check_p2p_order(schedule: Schedule, pp: int) -> None:
    """The k-th send from a to b must be the k-th receive on b from a (NCCL matches in order)."""
    place = placement_of(schedule)
    sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for r, row in enumerate(schedule):
        for a in row:
            if a.kind.is_send:
                sends[(r, peer_of(a, pp, place)[0])].append(a)
            elif a.kind.is_recv:
                recvs[(peer_of(a, pp, place)[0], r)].append(a)
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        out, into = sends[channel], recvs[channel]
        for k, (s, rv) in enumerate(zip(out, into, strict=False)):
            if matching_action(s, pp, place) != rv:
                raise ScheduleError(
                    f"p2p order differs on {src}->{dst}: send #{k} is {s} but receive #{k} is {rv}; "
                    "order both ends the same way"
                )
        if len(out) != len(into):
            extra = (out if len(out) > len(into) else into)[min(len(out), len(into))]
            raise ScheduleError(f"{extra} on {src}->{dst} has no matching {'receive' if extra in out else 'send'}")


def _report(schedule: Schedule, stuck: dict[int, tuple[list[Action], str]]) -> str:
    """Headline, one line per stuck rank, then the step x rank table with the stuck steps in brackets."""
    lines = [f"schedule deadlocks: no rank can progress ({len(stuck)} ranks stuck; [..] marks where)"]
    lines += [f"  rank {r}: {why}" for r, (_, why) in sorted(stuck.items())]
    width = max(len(str(a)) for row in schedule for a in row) + 2
    header = "step | " + " ".join(f"rank {r}".ljust(width) for r in range(len(schedule)))
    lines += [header, "-" * len(header)]
    for step in range(max(len(row) for row in schedule)):
        cells = []
        for r, row in enumerate(schedule):
            text = str(row[step]) if step < len(row) else ""
            marked = step < len(row) and row[step] in stuck.get(r, ([], ""))[0]
            cells.append((f"[{text}]" if marked else f" {text}").ljust(width))
        lines.append(f"{step:>4} | " + " ".join(cells))
    return "\n".join(lines)
