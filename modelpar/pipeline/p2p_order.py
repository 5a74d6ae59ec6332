"""Where each rank's SEND and RECV actions go, so that no two ranks can wait on each other.

Every transfer (a SEND on one rank and its RECV on the peer) gets a time stamp: the moment its data is
produced in the ideal unit-cost run of the compute order (``simulate.compute_timeline``). Each rank then
posts its transfers in stamp order, a RECV right before the first compute that starts at or after its stamp
and a SEND right after the compute that produced it. Because every rank's p2p sequence is a slice of one
global order, the lowest unfinished transfer is always at the head of both its ends' queues, so even with
blocking sends (NCCL) the ranks cannot wait on each other in a cycle; the same order also makes the k-th
send on a channel the k-th receive, which NCCL needs because it ignores tags.
"""

from __future__ import annotations

from modelpar.pipeline.actions import (
    INTERLEAVED,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    matching_action,
)
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.simulate import compute_timeline


def add_communication(compute: Schedule, pp: int, vpp: int = 1, placement: Placement = INTERLEAVED) -> Schedule:
    """Insert SEND/RECV actions into per-rank compute orders (F, B, W only); see the module docstring. Data
    that stays on its rank (the V placement's turnaround) needs none."""
    if len(compute) != pp:
        raise ScheduleError(f"got {len(compute)} rank lists for pp={pp}; give one list per pipeline rank")
    for r, row in enumerate(compute):
        for a in row:
            if not a.kind.is_compute:
                raise ScheduleError(f"{a} in rank {r}'s list: add_communication takes F, B and W actions only")
    ideal = compute_timeline(Schedule(compute, placement))
    last_stage = pp * vpp - 1
    transfers: list[list[tuple[tuple, Action]]] = [[] for _ in range(pp)]  # per rank: (stamp, op)
    for row in ideal.rows:
        for timed in row:
            a = timed.action
            stage = a.stage(pp, placement)
            if a.kind is F and stage < last_stage:
                send = Action(a.rank, SEND_F, a.micro_batch, a.chunk)
            elif a.kind is B and stage > 0:
                send = Action(a.rank, SEND_B, a.micro_batch, a.chunk)
            else:
                continue
            recv = matching_action(send, pp, placement)
            if recv.rank == send.rank:
                continue
            stamp = (timed.end, stage, a.kind is B, a.micro_batch)
            transfers[send.rank].append((stamp, send))
            transfers[recv.rank].append((stamp, recv))
    schedule = Schedule(placement=placement)
    for row, mine in zip(ideal.rows, transfers, strict=True):
        pending = sorted(mine, key=lambda item: item[0])
        out: list[Action] = []
        for timed in row:
            while pending and pending[0][0][0] <= timed.start:
                out.append(pending.pop(0)[1])
            out.append(timed.action)
        out += [op for _, op in pending]
        schedule.append(out)
    return schedule
