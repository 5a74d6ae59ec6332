"""Schedule generators: which compute actions each pipeline rank runs, in which order.

Schedules are data (``modelpar.pipeline.actions``). A generator decides the order of F, B and W on each
rank; ``modelpar.pipeline.p2p_order.add_communication`` then places the SEND/RECV actions, and
``modelpar.pipeline.simulate`` checks and times the result. A new schedule is a new generator here.
"""

from __future__ import annotations

from collections.abc import Callable

from modelpar.pipeline.actions import Action, B, F, Schedule, ScheduleError, W
from modelpar.pipeline.p2p_order import add_communication
from modelpar.pipeline.placement import Placement
from modelpar.pipeline.schedule_v import dual_pipe_v, zero_bubble_v

# -- generators: compute order per rank ------------------------------------------------------------------


def gpipe(pp: int, m: int, vpp: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards; keeps all ``m`` micro-batches in flight."""
    return add_communication(_gpipe_order(pp, m, vpp), pp, vpp)


def _gpipe_order(pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    _check_single_chunk("gpipe", vpp)
    return [[Action(r, F, j) for j in range(m)] + [Action(r, B, j) for j in range(m)] for r in range(pp)]


def one_f_one_b(pp: int, m: int, vpp: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Rank ``r`` runs ``pp - r - 1`` warm-up forwards, so at most ``min(m, pp - r)`` micro-batches are in flight
    on it. With ``m < pp`` the warm-up is cut to ``m`` and the schedule degenerates to GPipe's order.
    """
    return add_communication(_one_f_one_b_order(pp, m, vpp), pp, vpp)


def _one_f_one_b_order(pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    _check_single_chunk("1f1b", vpp)
    compute = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [Action(r, F, j) for j in range(warmup)]
        for j in range(m - warmup):
            order += [Action(r, F, warmup + j), Action(r, B, j)]
        order += [Action(r, B, j) for j in range(m - warmup, m)]
        compute.append(order)
    return compute


def interleaved(pp: int, m: int, vpp: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM form): ``vpp`` chunks per rank, bubble / ``vpp``.

    Forwards walk micro-batches in groups of ``pp``: chunk 0 of micro-batches 0..pp-1, then chunk 1 of the
    same group, ..., then the next group. Backwards walk the same order with chunks reversed. Rank ``r`` warms
    up with ``(pp - r - 1) * 2 + (vpp - 1) * pp`` forwards, then alternates one forward and one backward.
    """
    return add_communication(_interleaved_order(pp, m, vpp), pp, vpp)


def _interleaved_order(pp: int, m: int, vpp: int = 2) -> list[list[Action]]:
    if pp < 2:
        raise ScheduleError(f"interleaved needs pp >= 2 pipeline ranks (got pp={pp}); use '1f1b' for pp=1")
    if vpp < 2:
        raise ScheduleError(f"interleaved needs vpp >= 2 model chunks per rank (got vpp={vpp}); use '1f1b' for vpp=1")
    if m < pp or m % pp:
        below = m // pp * pp
        valid = [n for n in (below, below + pp) if n >= pp]
        raise ScheduleError(
            f"interleaved needs the micro-batch count to be a multiple of pp={pp} (got m={m}); try m in {valid}"
        )
    total = m * vpp

    def forward(k: int, r: int) -> Action:
        chunk = (k // pp) % vpp
        return Action(r, F, (k // (pp * vpp)) * pp + k % pp, chunk)

    def backward(k: int, r: int) -> Action:
        chunk = vpp - 1 - (k // pp) % vpp
        return Action(r, B, (k // (pp * vpp)) * pp + k % pp, chunk)

    compute = []
    for r in range(pp):
        warmup = min(total, (pp - r - 1) * 2 + (vpp - 1) * pp)
        order = [forward(k, r) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k, r), backward(k, r)]
        order += [backward(k, r) for k in range(total - warmup, total)]
        compute.append(order)
    return compute


def zero_bubble_h1(pp: int, m: int, vpp: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B (input grads) and W (weight grads).

    F and B keep 1F1B's order; rank ``r`` runs W of micro-batch ``j`` right after B of ``j + r`` and the
    last ``r`` W passes at the end, where 1F1B would idle waiting for gradients. Rank ``r`` then holds at
    most ``pp - r`` micro-batches before their B plus ``r`` awaiting W: ``pp``, 1F1B's peak (on rank 0).
    With unit costs (F = B = W = 1) the step takes ``3m + pp - 1``: the bubble is ``(pp-1)(F+B-W)`` against
    1F1B's ``(pp-1)(F+B+W)``.
    """
    return add_communication(_zero_bubble_h1_order(pp, m, vpp), pp, vpp)


def _zero_bubble_h1_order(pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    _check_single_chunk("zb-h1", vpp)
    compute = []
    for r, order in enumerate(_one_f_one_b_order(pp, m)):
        row = []
        for a in order:
            row.append(a)
            if a.kind is B and a.micro_batch >= r:
                row.append(Action(r, W, a.micro_batch - r))
        row += [Action(r, W, j) for j in range(max(0, m - r), m)]
        compute.append(row)
    return compute


def forward_only(name: str, pp: int, m: int, vpp: int = 1) -> Schedule:
    """The forwards of schedule ``name``, in its order, with their sends and receives: evaluation. Nothing
    waits on a backward, so no micro-batch is held once its output has been sent (or its loss taken)."""
    compute = [[a for a in row if a.kind is F] for row in compute_order(name, pp, m, vpp)]
    return add_communication(compute, pp, vpp, placement_for(name))


def single_micro_batch(name: str, pp: int, vpp: int = 1) -> Schedule:
    """One micro-batch through every chunk with the action kinds of schedule ``name`` (W after each B for the
    split-backward ones): forwards in model order, backwards in reverse. For rerunning one micro-batch of a
    step exactly as the step ran it (the silent-corruption check), whatever ``m`` the schedule needs."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    # interleaved needs pp >= 2 to be built at all, and never splits its backward; the V ones always split
    split = name in V_SCHEDULES or (
        name != "interleaved" and any(a.kind is W for row in SCHEDULES[name](1, 1, 1) for a in row)
    )
    place = placement_for(name)
    compute = []
    for r in range(pp):
        chunks = sorted(range(vpp), key=lambda c: place.stage(r, c, pp))  # this rank's chunks in model order
        row = [Action(r, F, 0, c) for c in chunks]
        for c in reversed(chunks):
            row.append(Action(r, B, 0, c))
            if split:
                row.append(Action(r, W, 0, c))
        compute.append(row)
    return add_communication(compute, pp, vpp, place)


def _check_single_chunk(name: str, vpp: int) -> None:
    if vpp != 1:
        raise ScheduleError(f"{name} runs one model chunk per rank (got vpp={vpp}); use vpp=1 or 'interleaved'")


# -- registry ---------------------------------------------------------------------------------------------

SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zero_bubble_h1,
    "zbv": zero_bubble_v,
    "dualpipev": dual_pipe_v,
}

# schedules that fold two chunks per rank in a V; every other one places chunks interleaved
V_SCHEDULES = ("zbv", "dualpipev")


def placement_for(name: str) -> Placement:
    """Where schedule ``name`` puts each model chunk: what partition, runtime and p2p peers all follow."""
    return Placement.V if name in V_SCHEDULES else Placement.INTERLEAVED


def build_schedule(name: str, pp: int, m: int, vpp: int = 1) -> Schedule:
    """Per-rank action lists (compute and communication) of schedule ``name`` for ``pp`` ranks, ``m`` micro-batches."""
    _check_request(name, pp, m, vpp)
    return SCHEDULES[name](pp, m, vpp)


# the compute order of each schedule that places its transfers after choosing it (the V ones choose among
# candidates by simulating them whole)
_COMPUTE_ORDERS: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "gpipe": _gpipe_order,
    "1f1b": _one_f_one_b_order,
    "interleaved": _interleaved_order,
    "zb-h1": _zero_bubble_h1_order,
}


def compute_order(name: str, pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    """Each rank's F, B and W actions of schedule ``name``, in ``build_schedule``'s order, without the transfers
    (what counting the activations or gradients a rank holds walks). Placing the transfers simulates the whole
    schedule: far the larger cost, about half a second a schedule at pp = 16."""
    _check_request(name, pp, m, vpp)
    if name in _COMPUTE_ORDERS:
        return _COMPUTE_ORDERS[name](pp, m, vpp)
    return [[a for a in row if a.kind.is_compute] for row in SCHEDULES[name](pp, m, vpp)]


def _check_request(name: str, pp: int, m: int, vpp: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    for field, value in (("pp", pp), ("m", m), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{field}={value!r} must be a positive integer")
