"""The search: every ``tp x cp x pp x dp (x ep)`` layout that can run the model, every micro-batching,
pipeline schedule (1F1B, interleaved at each ``vpp``, ZB-V, DualPipeV), recompute, ZeRO, SP and K/V exchange of
each, predicted (``modelpar.plan.step_time``) and ranked by tokens/s among those that fit; and the one-line
messages when none can run or none fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from modelpar.parallel.context import CP_COMMS
from modelpar.parallel.layout import LayoutError, ParallelLayout
from modelpar.pipeline.schedule import SCHEDULES, V_SCHEDULES
from modelpar.plan.bubble import bubble_ratio
from modelpar.plan.memo import search_memo
from modelpar.plan.saved import activation_bytes
from modelpar.plan.spec import (
    GIB,
    RECOMPUTE_MODES,
    SELECTIVE_CHOICES,
    CostModel,
    Hardware,
    ModelSpec,
    PlanError,
    PlannedLayout,
    Strategy,
)
from modelpar.plan.states import state_bytes
from modelpar.plan.step_time import predict

PLANNED_CP_COMMS = tuple(c for c in CP_COMMS if c != "hybrid")  # hybrid's group size is not searched


@dataclass(frozen=True)
class SearchSpace:
    """Which strategies ``plan`` tries; ``None`` leaves a degree free. Every choice is a tuple of options."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None  # expert parallel degree (mixture-of-experts models; free: every divisor of dp x cp)
    cp_comm: tuple[str, ...] = ("ring", "allgather", "alltoall")
    # parallel.schedule with pp > 1 (interleaved at every vpp up to max_vpp; zbv and dualpipev at vpp = 2);
    # gpipe and zb-h1 may be named too
    schedules: tuple[str, ...] = ("1f1b", "interleaved", *V_SCHEDULES)
    # the deepest pipeline the V schedules are searched at: each (pp, m) is simulated (modelpar.plan.bubble),
    # about a second per micro-batch count at pp = 16, a few at pp = 32
    max_v_pp: int = 8
    max_vpp: int = 4
    max_micro_batch_size: int = 8
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    # what our block's selective recompute may rerun (parallel.recompute_modules); the GPT block has one selective
    recompute_modules: tuple[tuple[str, ...], ...] = SELECTIVE_CHOICES
    zero: tuple[int, ...] = (0, 1, 2, 3)  # optim.zero stages to try
    sp: tuple[bool, ...] = (False, True)
    offload: tuple[bool, ...] = (False, True)  # parallel.offload_activations; True is tried where False misses


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _candidate_layouts(gpus: int, space: SearchSpace, experts: bool = False) -> list[ParallelLayout]:
    """Every ``tp x cp x pp x dp = gpus`` (vpp = 1) the search space allows; with ``experts``, every ep too."""
    out = []
    for tp in _divisors(gpus):
        for cp in _divisors(gpus // tp):
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                pins = ((space.tp, tp), (space.cp, cp), (space.pp, pp), (space.dp, dp))
                if all(want is None or want == got for want, got in pins):
                    for ep in _divisors(dp * cp) if experts else (1,):
                        if space.ep is None or space.ep == ep:
                            out.append(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep))
    return out


def layout_problem(
    model: ModelSpec, layout: ParallelLayout, global_batch: int, seq_len: int | None = None
) -> str | None:
    """Why ``layout`` cannot run ``model`` (the trainer's own checks, one line), or None."""
    if global_batch % layout.dp:
        return f"dp={layout.dp} does not divide the global batch {global_batch}"
    if seq_len is not None and layout.cp > 1 and seq_len % (2 * layout.cp):
        return f"cp={layout.cp} does not cut seq_len={seq_len} into 2*cp equal chunks"
    try:
        model.shape.check_layout(layout)
    except LayoutError as exc:
        return str(exc)
    return None


def valid_layouts(
    model: ModelSpec, gpus: int, global_batch: int, space: SearchSpace, seq_len: int | None = None
) -> list[ParallelLayout]:
    """Every ``tp x cp x pp x dp = gpus`` (vpp = 1) that shards the model and splits the batch (and sequence)."""
    return [
        layout
        for layout in _candidate_layouts(gpus, space, model.shape.moe.enabled)
        if layout_problem(model, layout, global_batch, seq_len) is None
    ]


def strategies(model: ModelSpec, layout: ParallelLayout, global_batch: int, seq_len: int, space: SearchSpace):
    """Every micro-batching, pipeline schedule, recompute (and our selective's modules), ZeRO and SP choice for
    one ``tp x pp x dp``, without offload (``plan`` adds it where a strategy does not fit)."""
    per_replica = global_batch // layout.dp
    for b in (k for k in _divisors(per_replica) if k <= space.max_micro_batch_size):
        m = per_replica // b
        for v, pipeline in pipelines(model, layout, m, space):
            chunked = dataclasses.replace(layout, vpp=v)
            for recompute in space.recompute:
                choices = space.recompute_modules if recompute == "selective" and model.block == "llama" else ((),)
                for modules in choices or (("elementwise",),):
                    for zero in zero_stages(model, layout, space, pipeline):
                        for sp in space.sp if layout.tp > 1 and seq_len % (layout.tp * layout.cp) == 0 else (False,):
                            for comm in cp_comms(model, layout, space) if layout.cp > 1 else ("ring",):
                                extra = {"recompute_modules": modules} if modules else {}
                                yield Strategy(chunked, b, m, recompute, zero, sp, comm, pipeline=pipeline, **extra)


def pipelines(model: ModelSpec, layout: ParallelLayout, m: int, space: SearchSpace) -> list[tuple[int, str]]:
    """The ``(vpp, Strategy.pipeline)`` pairs of ``space.schedules`` that ``modelpar-train`` runs at this layout and
    ``m`` (``modelpar.training.config.validate``): none but ``(1, "")`` without a pipeline; interleaved at each
    ``vpp`` from 2 whose ``pp * vpp`` chunks the layers fill and where ``pp`` divides ``m`` (it walks micro-batches
    in groups of pp); zbv and dualpipev at ``vpp = 2`` where ``2 pp <= layers`` (and ``pp <= space.max_v_pp``),
    dualpipev only where its simulated bubble is below zbv's (else it is as fast and holds more)."""
    p, layers = layout.pp, model.shape.layers
    if p == 1:
        return [(1, "")]
    out = []
    for name in space.schedules:
        if name == "1f1b":
            out.append((1, ""))
        elif name == "interleaved":
            out += [(v, "") for v in range(2, space.max_vpp + 1) if m % p == 0 and p * v <= layers]
        elif name in V_SCHEDULES:
            if 2 * p > layers or p > space.max_v_pp:
                continue
            # DualPipeV holds two chunks more than ZB-V at the same compute: tried only where it idles less
            if name == "dualpipev" and "zbv" in space.schedules:
                if bubble_ratio("dualpipev", p, m, 2) >= bubble_ratio("zbv", p, m, 2):
                    continue
            out.append((2, name))
        else:  # gpipe, zb-h1: one chunk per rank
            out.append((1, name))
    return out


def cp_comms(model: ModelSpec, layout: ParallelLayout, space: SearchSpace) -> tuple[str, ...]:
    """The cp exchanges to try: all-to-all only where cp splits the query heads of a tp rank."""
    splits = (model.shape.heads // layout.tp) % layout.cp == 0
    return tuple(c for c in space.cp_comm if c != "alltoall" or splits)


def zero_stages(model: ModelSpec, layout: ParallelLayout, space: SearchSpace, pipeline: str = "") -> tuple[int, ...]:
    """The ZeRO stages worth trying: none without dp x cp. With ep > 1 the trainer shards expert weights over the
    expert data-parallel group (dp x cp / ep ranks), which the memory and time model do not describe yet: the
    planner keeps those layouts at zero-0 rather than predict a sharding the trainer does not do. A V schedule
    (``pipeline``) with tied embeddings runs at zero 0-1 only (rank 0 holds both ends, one weight in two FSDP
    units: the trainer refuses it)."""
    if layout.dp * layout.cp == 1 or layout.ep > 1:
        return (0,)
    if pipeline in V_SCHEDULES and model.tie_embeddings:
        return tuple(z for z in space.zero if z < 2)
    return tuple(space.zero)


def plan(
    model: ModelSpec,
    hardware: Hardware,
    *,
    gpus: int,
    global_batch: int,
    seq_len: int,
    costs: CostModel | None = None,
    space: SearchSpace | None = None,
    progress: Callable[[list[ParallelLayout]], Iterable[ParallelLayout]] | None = None,
) -> list[PlannedLayout]:
    """Strategies that fit in memory, fastest first (tokens/s, then less memory). Raises ``PlanError``.

    ``progress`` wraps the list of layouts searched (a progress bar: ``modelpar-plan`` on a terminal).

    Recompute and offload only ever add time, so a strategy that fits without them is not tried with them
    (its recomputing variants would rank below it), and offload is tried only where a strategy misses."""
    space = space or SearchSpace()
    check_inputs(gpus=gpus, global_batch=global_batch, seq_len=seq_len, space=space)
    layouts = valid_layouts(model, gpus, global_batch, space, seq_len)
    if not layouts:
        raise PlanError(no_layout_message(model, gpus, global_batch, space, seq_len))
    with search_memo():
        planned, closest = _search(model, hardware, layouts, global_batch, seq_len, costs, space, progress)
        if not planned:  # the closest miss may be one whose model states alone were too many: search them too
            search = (model, hardware, layouts, global_batch, seq_len, costs, space, None)
            planned, closest = _search(*search, prune=False)
    if not planned:
        raise PlanError(nothing_fits_message(closest, hardware))
    planned.sort(key=lambda e: (-e.prediction.tokens_per_s, e.prediction.memory.total))
    return planned


def _search(
    model: ModelSpec,
    hardware: Hardware,
    layouts: list[ParallelLayout],
    global_batch: int,
    seq_len: int,
    costs: CostModel | None,
    space: SearchSpace,
    progress: Callable[[list[ParallelLayout]], Iterable[ParallelLayout]] | None,
    prune: bool = True,
) -> tuple[list[PlannedLayout], PlannedLayout | None]:
    """(the strategies that fit, the closest miss) over ``layouts``. ``prune``: a strategy whose model states
    cannot fit (``_states_exceed``) is not predicted, and the closest miss is then not known."""
    planned, closest = [], None
    fits_as_is: set[tuple] = set()  # strategies that fit without recompute: recomputing them only costs time
    for layout in progress(layouts) if progress else layouts:
        for strategy in strategies(model, layout, global_batch, seq_len, space):
            if strategy.recompute != "none" and _but_recompute(strategy) in fits_as_is:
                continue
            if prune and _states_exceed(model, strategy, seq_len, hardware):
                continue
            prediction = predict(strategy, model, hardware, seq_len=seq_len, costs=costs)
            if strategy.recompute == "none" and prediction.fits:
                fits_as_is.add(_but_recompute(strategy))
            if not prediction.fits:
                # reducing every micro-batch and offload only cost time: tried only where the strategy misses
                for change in _memory_savers(model, strategy, hardware, space):
                    trial = dataclasses.replace(strategy, **change)
                    guess = predict(trial, model, hardware, seq_len=seq_len, costs=costs)
                    if guess.fits or guess.memory.total < prediction.memory.total:
                        strategy, prediction = trial, guess
                    if guess.fits:
                        break
            entry = PlannedLayout(strategy, prediction)
            if prediction.fits:
                planned.append(entry)
            elif closest is None or prediction.memory.total < closest.prediction.memory.total:
                closest = entry
    return planned, closest


def _states_exceed(model: ModelSpec, strategy: Strategy, seq_len: int, hardware: Hardware) -> bool:
    """Whether the first stage's model states and the reserved bytes alone exceed the device (our block), for
    ``strategy`` and every memory saver of it: reducing every micro-batch changes only the gathered copies,
    left out here, offload only activations, and activations and gathered copies only add (in floats too:
    this sum is the first terms of ``MemoryBreakdown.total``'s, in its order)."""
    if model.block != "llama":
        return False
    states = state_bytes(model, strategy, seq_len, 0, activation_bytes(hardware))
    lower = states["weights"] + states["gradients"] + states["optimizer"] + states["buffers"]
    return lower + hardware.reserved_bytes > hardware.memory_bytes


_BUT_RECOMPUTE = tuple(f.name for f in dataclasses.fields(Strategy) if f.name not in ("recompute", "recompute_modules"))


def _but_recompute(strategy: Strategy) -> tuple:
    """Every field of ``strategy`` but its recompute: equal for a strategy and its recomputing variants."""
    return tuple(getattr(strategy, name) for name in _BUT_RECOMPUTE)


def _memory_savers(model: ModelSpec, strategy: Strategy, hardware: Hardware, space: SearchSpace) -> list[dict]:
    """What else could make ``strategy`` fit, cheapest first: ZeRO-2/3 reducing every micro-batch's gradients
    (FSDP2 then keeps no unsharded gradients across them), offload (our block, a device with its own memory:
    not a CPU), both."""
    savers = []
    if strategy.zero >= 2 and strategy.micro_batches > 1 and strategy.layout.dp * strategy.layout.cp > 1:
        savers.append({"reduce_every_micro_batch": True})
    if True in space.offload and model.block == "llama" and hardware.host_bw:
        savers.append({"offload": True})
        if savers[0] != {"offload": True}:
            savers.append({"reduce_every_micro_batch": True, "offload": True})
    return savers


def check_inputs(*, gpus: int, global_batch: int, seq_len: int, space: SearchSpace) -> None:
    for name, value in (("gpus", gpus), ("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    for name in ("tp", "cp", "pp", "dp"):
        want = getattr(space, name)
        if want is not None and (want < 1 or gpus % want):
            raise PlanError(f"{name}={want} does not divide gpus={gpus}; try {name} in {_divisors(gpus)}")
    if not space.cp_comm or any(c not in PLANNED_CP_COMMS for c in space.cp_comm):
        raise PlanError(f"cp_comm={list(space.cp_comm)} must list ways from {', '.join(PLANNED_CP_COMMS)}")
    if not space.schedules or any(name not in SCHEDULES for name in space.schedules):
        raise PlanError(f"schedules={list(space.schedules)} must list pipeline schedules from {', '.join(SCHEDULES)}")
    bad = [r for r in space.recompute if r not in RECOMPUTE_MODES]
    if bad or not space.recompute:
        raise PlanError(f"recompute={list(space.recompute)} must list modes from {', '.join(RECOMPUTE_MODES)}")
    known = ("attention", "mlp", "elementwise")
    for modules in space.recompute_modules:
        if not modules or set(modules) - set(known):
            raise PlanError(f"recompute_modules={list(modules)} must name some of {', '.join(known)}")


def no_layout_message(
    model: ModelSpec, gpus: int, global_batch: int, space: SearchSpace, seq_len: int | None = None
) -> str:
    candidates = sorted(range(max(1, gpus - 64), gpus + 65), key=lambda n: (abs(n - gpus), n))
    nearest = [n for n in candidates if n != gpus and valid_layouts(model, n, global_batch, space, seq_len)][:3]
    fix = f"try {' or '.join(map(str, sorted(nearest)))} GPUs" if nearest else "change the GPU count or the batch"
    problems = []
    for layout in _candidate_layouts(gpus, space):
        problem = layout_problem(model, layout, global_batch, seq_len)
        if problem is not None and problem not in problems:
            problems.append(problem)
    why = "; ".join(problems[:2]) + (f" (and {len(problems) - 2} more)" if len(problems) > 2 else "")
    if not problems:
        why = f"the search space allows no factorisation of {gpus} GPUs"
    return f"no tp x pp x dp factorisation of {gpus} GPUs suits {model.name}: {why}; {fix}"


def nothing_fits_message(closest: PlannedLayout, hardware: Hardware) -> str:
    memory = closest.prediction.memory
    states = memory.weights + memory.grads + memory.optimizer + memory.reserved
    fix = (
        "the model states alone exceed the device: add GPUs or memory"
        if states > hardware.memory_bytes
        else "shorten the micro-batch/sequence or add GPUs"
    )
    return (
        f"nothing fits in {hardware.memory_bytes / GIB:.1f} GiB per device: the closest, {closest.strategy}, needs "
        f"{memory.total / GIB:.1f} GiB on its {memory.stage} stage, missing by "
        f"{(memory.total - hardware.memory_bytes) / GIB:.1f} GiB; {fix}"
    )
