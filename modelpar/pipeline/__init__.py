"""Pipeline parallelism: layers -> chunks (partition), schedules as data (actions, schedule, p2p_order),
their timing and deadlock check (simulate, gantt), and the executor of one rank's list (runtime)."""

from modelpar.pipeline.actions import Action, ActionKind, Schedule, ScheduleError, format_schedule, parse_schedule
from modelpar.pipeline.partition import (
    Partition,
    PartitionError,
    partition_by_cost,
    partition_explicit,
    partition_uniform,
)
from modelpar.pipeline.runtime import PipelineRuntime, StepResult, measured_timeline
from modelpar.pipeline.schedule import SCHEDULES, build_schedule
from modelpar.pipeline.simulate import Costs, ScheduleDeadlock, Simulation, Timeline, compute_timeline, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Costs",
    "Partition",
    "PartitionError",
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
    "measured_timeline",
    "parse_schedule",
    "partition_by_cost",
    "partition_explicit",
    "partition_uniform",
    "simulate",
]
