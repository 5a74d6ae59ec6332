"""V-shaped schedules: two chunks per rank folded in a V (``Placement.V``), backward split into B and W.

Both are list schedules: a unit-cost run (F = B = W = 1, as the papers assume) in which every free rank
takes the most urgent action that is ready, under a cap on the activations it holds. The order that run
produces is the schedule; ``simulate`` then proves it. Written this way they need no case analysis for
``m < 2 * pp`` and keep their shape for any ``m``.

``zbv`` (Qi et al. 2024, ZB-V): priority B > F > W, or F > B > W with each W right after its B while the
rank has forwards left; both orders are built and the one with the smaller unit-cost bubble kept (B-first
wins at m <= pp, F-first at pp 8, m >= 2 pp: 6.8% against 8.6% at m = 16). B is on the critical path and frees the rank
downstream; F keeps the pipe full; W fills what would be bubble. The cap is ``2 * pp`` chunk activations
(a chunk is half a 1F1B stage, so this is 1F1B's peak of ``pp`` stage activations, now on every rank); a
forward of the first leg (local chunk 0) must leave one place free for the second leg, without which rank 0
could fill up with first-leg forwards and never take the second-leg forward that leads to a backward.

``dualpipev`` (DeepSeek-V3 report sec. 3.2.1, the V-shaped half of DualPipe): when a forward and a
backward of different micro-batches are both ready, the rank runs them as one overlapped pair, written as
two adjacent actions ``F`` then ``B``, with the backward whole (its W right after). Only where no pair is
possible does it split a backward and defer its W, as DualPipe's cool-down does. On a GPU the pair is where
one micro-batch's expert all-to-all hides behind the other's compute; in this runtime the two run one after
the other on one thread, so the pairing is an order, not an overlap. The cap is ``2 * pp + 2`` (a pair
takes its forward before its backward frees anything) or ``2 * pp + 1``, torch's peak: both are built and the one
with the smaller unit-cost bubble kept, the lower cap at a tie (every m >= 2 pp; only at m just above pp does
the higher cap idle less).
"""

from __future__ import annotations

from modelpar.pipeline.actions import Action, B, F, Schedule, ScheduleError, W, input_recv
from modelpar.pipeline.p2p_order import add_communication
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.simulate import Costs, simulate

V = Placement.V
_UNIT = Costs(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)


def zero_bubble_v(pp: int, m: int, vpp: int = 2) -> Schedule:
    """ZB-V: see the module docstring. ``vpp`` must be 2 (two chunks per rank)."""
    _check("zbv", pp, vpp)
    candidates = []
    for forward_first in (False, True):
        orders = _list_schedule(pp, m, cap=2 * pp, forward_first=forward_first)
        candidates.append(add_communication(orders, pp, 2, V))
    return min(candidates, key=lambda s: _unit_cost(s)[0])  # the first candidate wins ties


def dual_pipe_v(pp: int, m: int, vpp: int = 2) -> Schedule:
    """DualPipeV: see the module docstring. ``vpp`` must be 2 (two chunks per rank)."""
    _check("dualpipev", pp, vpp)
    candidates = []
    for cap in (2 * pp + 1, 2 * pp + 2):
        paired: set[tuple[Action, Action]] = set()
        orders = _list_schedule(pp, m, cap=cap, paired=paired)
        candidates.append(_with_runnable_pairs(add_communication(orders, pp, 2, V), paired))
    return min(candidates, key=_unit_cost)  # the smaller bubble; at a tie, the fewer activations held


def _with_runnable_pairs(schedule: Schedule, pairs: set[tuple[Action, Action]]) -> Schedule:
    """The schedule with the pairs the runtime can run at once: those whose backward's input is received
    before the forward (``add_communication`` stamps it before the forward's start). The transfers between
    the two (the forward's send, receives for later actions) are posted when the forward ends, while the
    backward may still run. ``pair_proof`` is the list that posts them after the backward instead, later
    than any run does; ``simulate`` proves it (``check_schedule``) as it proves every schedule."""
    kept = set()
    pp, last = len(schedule), 2 * len(schedule) - 1
    for row in schedule:
        position = {a: i for i, a in enumerate(row)}
        for forward, backward in pairs:
            if forward not in position or position[backward] < position[forward]:
                continue
            recv = input_recv(backward, pp, last, schedule.placement)
            if recv is None or position[recv] < position[forward]:
                kept.add((forward, backward))
    return Schedule(schedule, schedule.placement, kept)


def pair_proof(schedule: Schedule) -> Schedule:
    """``schedule`` with each pair's in-between transfers moved after its backward (see ``_with_runnable_pairs``)."""
    rows = []
    for row in schedule:
        row = list(row)
        for forward, backward in sorted(p for p in schedule.pairs if p[0].rank == (row[0].rank if row else -1)):
            i, j = row.index(forward), row.index(backward)
            row[i : j + 1] = [forward, backward, *row[i + 1 : j]]
        rows.append(row)
    return Schedule(rows, schedule.placement)


def _unit_cost(schedule: Schedule) -> tuple[float, int]:
    """The simulated bubble and peak activations (chunks) at unit costs, as the list run assumes."""
    sim = simulate(schedule, _UNIT)
    return sim.bubble_fraction, max(sim.peak_in_flight)


def _check(name: str, pp: int, vpp: int) -> None:
    if vpp != 2:
        raise ScheduleError(f"{name} runs two model chunks per rank in a V (got vpp={vpp}); use vpp=2")


def _list_schedule(
    pp: int, m: int, *, cap: int, forward_first: bool = False, paired: set | None = None
) -> list[list[Action]]:
    """Per-rank compute orders (F, B, W on local chunks 0 and 1) from one unit-cost greedy run.

    ``forward_first`` (zbv only) changes the priority to F > B > W, with each B's W taken right after it
    while the rank still has forwards to run (so the cap is not reached early) and deferred once it has none.
    ``paired`` (dualpipev): run a ready forward and backward as one pair, and collect the (forward, backward)
    pairs into it.
    """
    run = _Run(pp, m)
    held = [0] * pp  # activations from F until W
    waiting_w: list[list[Action]] = [[] for _ in range(pp)]  # B done, W not yet, oldest first
    free_at = [0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]
    total = 3 * 2 * m * pp
    t = 0
    while sum(len(o) for o in orders) < total:
        if t > 4 * total:  # every action takes one unit: a run this long has stalled
            raise ScheduleError(f"the V list schedule stalls at pp={pp}, m={m}; use schedule=zb-h1 or 1f1b")
        for r in range(pp):
            if free_at[r] > t:
                continue
            # B-first: the second leg's backward (nearest the input) first, the forward further along the V first
            backward = run.ready(r, B, 0, t) or run.ready(r, B, 1, t)
            forwards = (run.ready(r, F, 1, t), run.ready(r, F, 0, t))
            forward = next((a for a in forwards if a is not None and held[r] + 1 + (a.chunk == 0) <= cap), None)
            if paired is not None and forward is not None and backward is not None:
                step = [forward, backward, _weight(backward)]
                paired.add((forward, backward))
            elif forward_first and forward is not None:
                step = [forward]
            elif forward_first and backward is not None:
                step = [backward, _weight(backward)] if run.forwards_left(r) else [backward]
            elif backward is not None:
                step = [backward]
            elif forward is not None:
                step = [forward]
            elif waiting_w[r]:
                step = [waiting_w[r].pop(0)]
            else:
                continue
            for a in step:
                free_at[r] = max(free_at[r], t) + 1
                run.finish(a, free_at[r])
                orders[r].append(a)
                held[r] += 1 if a.kind is F else -1 if a.kind is W else 0
                if a.kind is B and _weight(a) not in step:
                    waiting_w[r].append(_weight(a))
        t += 1
    return orders


class _Run:
    """What has run so far in the unit-cost run, and when each action ended."""

    def __init__(self, pp: int, m: int):
        self.pp, self.m, self.last = pp, m, 2 * pp - 1
        self.done: dict[Action, int] = {}
        self.next = {(r, kind, c): 0 for r in range(pp) for kind in (F, B) for c in (0, 1)}  # next micro-batch

    def ready(self, rank: int, kind, chunk: int, t: int) -> Action | None:
        """The next ``kind`` on ``rank``'s local ``chunk`` if its inputs exist at time ``t``."""
        j = self.next[(rank, kind, chunk)]
        if j >= self.m:
            return None
        stage = V.stage(rank, chunk, self.pp)
        if kind is F:
            source = None if stage == 0 else _on(stage - 1, self.pp, F, j)
        else:
            if not self._done_by(Action(rank, F, j, chunk), t):
                return None
            source = None if stage == self.last else _on(stage + 1, self.pp, B, j)
        if source is not None and not self._done_by(source, t):
            return None
        return Action(rank, kind, j, chunk)

    def forwards_left(self, rank: int) -> bool:
        return any(self.next[(rank, F, c)] < self.m for c in (0, 1))

    def finish(self, action: Action, end: int) -> None:
        self.done[action] = end
        if action.kind is not W:
            self.next[(action.rank, action.kind, action.chunk)] += 1

    def _done_by(self, action: Action, t: int) -> bool:
        return self.done.get(action, t + 1) <= t


def _on(stage: int, pp: int, kind, micro_batch: int) -> Action:
    rank, chunk = V.locate(stage, pp)
    return Action(rank, kind, micro_batch, chunk)


def _weight(backward: Action) -> Action:
    return Action(backward.rank, W, backward.micro_batch, backward.chunk)
