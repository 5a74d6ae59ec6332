"""The pipeline bubble of each schedule: idle time on the busiest rank over its compute time.

The step spans the compute of one rank plus its idle time, so ``bubble_s = bubble_ratio * busy_s``::

    gpipe, 1f1b      (p - 1) / m             (Narayanan et al. 2021; GPipe idles as long, holding more)
    interleaved      (p - 1) / (v * m)
    zb-h1, zbv,      the schedule simulator's idle time over the compute, with every chunk's F, B (input
    dualpipev        gradient) and W (weight gradients) one unit each, as the papers and the generators assume
                     (``modelpar.pipeline.schedule_v``): ``(makespan - 3 v m) / (3 v m)``

The simulated ones have no closed form (the V schedules are greedy list schedules), so the simulator
(``modelpar.pipeline.simulate``'s compute timeline) runs once per ``(schedule, pp, m, vpp)`` and is cached.
Past ``m = 4 p`` the steady state repeats with a period dividing ``2 p`` micro-batches and the idle time with
it, so ``m`` is folded into ``(2p, 4p]`` first (``folded_micro_batches``; checked equal to the direct simulation
in ``tests/plan/test_plan_schedules.py``): a search over large batches simulates at most ``2p`` schedules per
``p``.
"""

from __future__ import annotations

import functools

from modelpar.pipeline.schedule import V_SCHEDULES, build_schedule
from modelpar.pipeline.simulate import Costs, compute_timeline

# F, B and W of one chunk one unit each; an unsplit backward (1f1b's B) is B + W
UNIT_COSTS = Costs(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)
SIMULATED = ("zb-h1", *V_SCHEDULES)  # schedules whose bubble comes from the simulator


def folded_micro_batches(pp: int, m: int) -> int:
    """``m`` itself up to ``4 p``; beyond, the ``m'`` in ``(2p, 4p]`` with ``m' = m (mod 2p)``, whose simulated
    schedule idles as long (module docstring)."""
    if m <= 4 * pp:
        return m
    return 2 * pp + 1 + (m - 2 * pp - 1) % (2 * pp)


@functools.lru_cache(maxsize=4096)
def bubble_ratio(schedule: str, pp: int, m: int, vpp: int = 1) -> float:
    """Idle time over compute time on the busiest rank of ``schedule`` (module docstring); 0 without a pipeline."""
    if pp == 1:
        return 0.0
    if schedule not in SIMULATED:
        return (pp - 1) / (vpp * m)
    return _idle_units(schedule, pp, folded_micro_batches(pp, m), vpp) / (3 * vpp * m)


@functools.lru_cache(maxsize=1024)
def _idle_units(schedule: str, pp: int, m: int, vpp: int) -> float:
    """Unit-cost idle time of the rank that finishes last (every rank computes ``3 v m`` units). Without p2p
    latency the compute timeline ends where ``simulate``'s does (its transfers are placed not to delay it), at
    a quarter of the cost."""
    return compute_timeline(build_schedule(schedule, pp, m, vpp), UNIT_COSTS).end - 3 * vpp * m
