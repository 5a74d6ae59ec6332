"""Pipeline parallelism.

placement       model chunk <-> (rank, local chunk): interleaved (Megatron) or V (zbv, dualpipev)
partition       layers -> model chunks -> ranks (uniform, by cost, explicit), placed by ``placement``
actions         the schedule IR: ``Action`` ("1F0", "0B3c1", "1RECV_F0"), per-rank lists, parse/format
schedule        generators (gpipe, 1f1b, interleaved, zb-h1), ``SCHEDULES``, ``build_schedule``, ``forward_only``
schedule_v      the V-shaped ones (zbv, dualpipev) as unit-cost list schedules
p2p_order       where SEND/RECV go so that no schedule can deadlock, even with NCCL's blocking sends
simulate        timeline, bubble, peak in-flight activations, ``ScheduleDeadlock`` with a step x rank table
gantt           text and PNG Gantt charts of a simulated or measured timeline
split_backward  B (input gradient) and W (weight gradients) for zero-bubble schedules
runtime         ``PipelineRuntime``: executes one rank's list with batched isend/irecv

The function ``simulate`` is re-exported here, so as a package attribute it hides the module of that name:
write ``from modelpar.pipeline.simulate import ...``, not ``import modelpar.pipeline.simulate as s``.
"""

from modelpar.pipeline.actions import Action, ActionKind, Schedule, ScheduleError, format_schedule, parse_schedule
from modelpar.pipeline.partition import (
    Partition,
    PartitionError,
    partition_by_cost,
    partition_explicit,
    partition_uniform,
)
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.runtime import PipelineRuntime, StepResult, measured_timeline
from modelpar.pipeline.schedule import SCHEDULES, build_schedule, forward_only, placement_for
from modelpar.pipeline.simulate import Costs, ScheduleDeadlock, Simulation, Timeline, compute_timeline, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Costs",
    "Partition",
    "PartitionError",
    "Placement",
    "PipelineRuntime",
    "Schedule",
    "ScheduleDeadlock",
    "ScheduleError",
    "Simulation",
    "StepResult",
    "Timeline",
    "build_schedule",
    "compute_timeline",
    "format_schedule",
    "forward_only",
    "measured_timeline",
    "parse_schedule",
    "partition_by_cost",
    "partition_explicit",
    "partition_uniform",
    "placement_for",
    "simulate",
]
