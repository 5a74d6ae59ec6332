"""PyTorch's own V schedules as modelpar action lists, so that one simulator and one cost model judge both.

``torch_order("zbv" | "dualpipev", pp, m)`` reads the per-rank compute order that torch's
``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` generate (their generator needs no process group) and
translates it action by action: stage -> local chunk of the V placement, an overlapped F+B pair as the F then
the B it holds, a full backward as B then W. ``add_communication`` then gives it the same sends and receives
as ours.
"""

from __future__ import annotations

from modelpar.pipeline.actions import Action, ActionKind, Schedule
from modelpar.pipeline.placement import Placement


def torch_v_class(name: str):
    """torch's schedule class of our V schedule ``name`` (zbv, dualpipev)."""
    from torch.distributed.pipelining import schedules as ts

    return {"zbv": ts.ScheduleZBVZeroBubble, "dualpipev": ts.ScheduleDualPipeV}[name]


def torch_order(name: str, pp: int, m: int) -> Schedule:
    """The compute order torch's schedule class ``name`` generates (no process group needed to ask for it)."""
    from torch.distributed.pipelining import schedules as ts

    sched = object.__new__(torch_v_class(name))  # the generator reads only these three fields
    sched.pp_group_size, sched._n_microbatches, sched.num_stages = pp, m, 2 * pp
    rows = []
    for rank in range(pp):
        row = []
        for act in sched._calculate_single_rank_operations(rank):
            if act is not None:
                row.extend(_translate(act, rank, pp, ts))
        rows.append(row)
    return Schedule(rows, Placement.V)


def _translate(act, rank: int, pp: int, ts) -> list[Action]:
    kind = act.computation_type
    if kind == ts.OVERLAP_F_B:
        return [a for sub in act.sub_actions for a in _translate(sub, rank, pp, ts)]
    chunk = 0 if act.stage_index == rank else 1
    if chunk == 1 and act.stage_index != 2 * pp - 1 - rank:
        raise ValueError(f"stage {act.stage_index} is not on rank {rank} in a V of {pp} ranks")
    mb = act.microbatch_index
    if kind == ts.FORWARD:
        return [Action(rank, ActionKind.F, mb, chunk)]
    if kind == ts.BACKWARD_INPUT:
        return [Action(rank, ActionKind.B, mb, chunk)]
    if kind == ts.BACKWARD_WEIGHT:
        return [Action(rank, ActionKind.W, mb, chunk)]
    if kind == ts.FULL_BACKWARD:
        return [Action(rank, ActionKind.B, mb, chunk), Action(rank, ActionKind.W, mb, chunk)]
    raise ValueError(f"unexpected torch action {act}")
