"""Why the chosen strategy runs its ZeRO stage, recompute, offload, pipeline schedule (pp > 1) and cp exchange
(cp > 1): the same strategy predicted with that one choice changed, and what would not fit or would be slower."""

from __future__ import annotations

import dataclasses

from modelpar.plan.activations import offloaded_per_micro_batch
from modelpar.plan.search import SearchSpace, cp_comms, pipelines, zero_stages
from modelpar.plan.spec import GIB, CostModel, Hardware, ModelSpec, PlannedLayout, Prediction, Strategy
from modelpar.plan.step_time import cp_bytes_per_layer, offload_per_micro_batch_s, predict


def explain(
    best: PlannedLayout,
    model: ModelSpec,
    hardware: Hardware,
    *,
    seq_len: int,
    costs: CostModel | None = None,
    space: SearchSpace | None = None,
) -> list[str]:
    """Why the chosen strategy runs its ZeRO stage, recompute and offload, and with a pipeline its schedule, with
    context parallelism its exchange: one line each, from predicting the same strategy with that one choice
    changed (what would not fit, and what would be slower)."""
    space = space or SearchSpace()
    s, gib = best.strategy, hardware.memory_bytes / GIB

    def variant(**change) -> Prediction:
        return predict(dataclasses.replace(s, **change), model, hardware, seq_len=seq_len, costs=costs)

    def against(label: str, p: Prediction) -> str:
        if not p.fits:
            states = (p.memory.states + p.memory.reserved) / GIB
            return f"{label} needs {p.memory.total / GIB:.1f} GiB ({states:.1f} of it model states)"
        slower = best.prediction.tokens_per_s / p.tokens_per_s - 1
        way = "slower" if slower >= 0 else "faster"
        return f"{label} fits at {p.memory.total / GIB:.1f} GiB but is {abs(slower):.0%} {way}"

    chosen = f"{best.prediction.memory.total / GIB:.1f} of {gib:.0f} GiB"
    stages = [z for z in zero_stages(model, s.layout, space, s.pipeline) if z != s.zero]
    what = {0: "nothing sharded", 1: "optimizer state sharded", 2: "gradients too", 3: "weights too"}
    every = ", gradients reduced every micro-batch" if s.reduce_every_micro_batch else ""
    zero = f"zero-{s.zero} ({what[s.zero]}{every}, {chosen})"
    if s.reduce_every_micro_batch:
        stages = [z for z in stages if z < 2]
        zero += (
            ": " + against("reducing once a step", variant(reduce_every_micro_batch=False)) + ("; " if stages else "")
        )
        if stages:
            zero += "; ".join(against(f"zero-{z}", variant(zero=z, reduce_every_micro_batch=False)) for z in stages)
        stages = []
    if stages:
        zero += ": " + "; ".join(against(f"zero-{z}", variant(zero=z)) for z in stages)
    elif not s.reduce_every_micro_batch:
        if s.layout.dp * s.layout.cp == 1:
            zero += ": no dp x cp replicas to shard over"
        elif s.layout.ep > 1:
            zero += ": not searched with expert parallelism (ep > 1)"
    # the other modes: none, the best of the selective choices (the fastest that fits, else the smallest), full
    options = []
    if s.recompute != "none" and "none" in space.recompute:
        options.append(dataclasses.replace(s, recompute="none"))
    if "selective" in space.recompute:
        choices = space.recompute_modules if model.block == "llama" else (s.recompute_modules,)
        others = [
            dataclasses.replace(s, recompute="selective", recompute_modules=mods)
            for mods in choices
            if (s.recompute, s.recompute_modules) != ("selective", tuple(mods))
        ]
        scored = [(o, predict(o, model, hardware, seq_len=seq_len, costs=costs)) for o in others]
        if scored:
            options.append(
                max(scored, key=lambda op: (op[1].fits, op[1].tokens_per_s if op[1].fits else -op[1].memory.total))[0]
            )
    if s.recompute != "full" and "full" in space.recompute:
        options.append(dataclasses.replace(s, recompute="full"))
    recompute = f"recompute {s.recompute_label}"
    if options:
        recompute += ": " + "; ".join(
            against(o.recompute_label, predict(o, model, hardware, seq_len=seq_len, costs=costs)) for o in options
        )
    if s.offload:
        offload = "offload on: " + against("without it", variant(offload=False))
    elif model.block == "gpt":
        offload = "offload: not modelled for the GPT block"
    elif not hardware.host_bw:
        offload = f"offload off: {hardware.name}'s memory is host memory, moving activations there frees nothing"
    else:
        moved = offloaded_per_micro_batch(model, s, seq_len, hardware, stage=0) * s.micro_batches
        m_s = (
            offload_per_micro_batch_s(model, dataclasses.replace(s, offload=True), seq_len, hardware) * s.micro_batches
        )
        offload = (
            f"offload off: it fits without; moving {moved / GIB:.1f} GiB a step over "
            f"{hardware.host_bw / 1e9:.0f} GB/s would add {m_s:.2f} s"
        )
    lines = [f"why {zero}", f"why {recompute}", f"why {offload}"]
    if s.layout.pp > 1:
        lines.append("why " + _schedule_reason(best, model, space, variant, against))
    if s.layout.cp > 1:
        lines.append("why " + _cp_comm_reason(best, model, hardware, seq_len, space, variant, against))
    return lines


def schedule_label(s: Strategy) -> str:
    """``1f1b``, ``interleaved-vpp4``, ``zbv`` ...: the schedule and, interleaved, its chunks per rank."""
    return f"interleaved-vpp{s.layout.vpp}" if s.schedule_name == "interleaved" else s.schedule_name


def _schedule_reason(best: PlannedLayout, model: ModelSpec, space: SearchSpace, variant, against) -> str:
    """``schedule zbv (bubble 4.5% of the step, 3.1 GiB activations): 1f1b bubble 27.0%, 3.1 GiB activations,
    fits at .. but is 30% slower; ...``: each other schedule of the space that runs here (interleaved at its
    fastest vpp)."""
    s, p = best.strategy, best.prediction
    layout = dataclasses.replace(s.layout, vpp=1)
    others: dict[str, tuple[Strategy, Prediction]] = {}
    for v, pipeline in pipelines(model, layout, s.micro_batches, space):
        if (v, pipeline) == (s.layout.vpp, s.pipeline) or s.zero not in zero_stages(model, layout, space, pipeline):
            continue
        other = dataclasses.replace(s, layout=dataclasses.replace(layout, vpp=v), pipeline=pipeline)
        name = other.schedule_name
        guess = variant(layout=other.layout, pipeline=pipeline)
        kept = others.get(name)
        if kept is None or (guess.fits, guess.tokens_per_s) > (kept[1].fits, kept[1].tokens_per_s):
            others[name] = (other, guess)

    def shape(q: Prediction, of: str = "") -> str:
        return f"bubble {q.bubble_s / q.total_s:.1%}{of}, {q.memory.activations / GIB:.3g} GiB activations"

    head = f"schedule {schedule_label(s)} ({shape(p, ' of the step')})"
    if not others:
        return head + ": the only schedule searched that runs here"
    return head + ": " + "; ".join(f"{schedule_label(o)} {shape(q)}: " + against("it", q) for o, q in others.values())


def _cp_comm_reason(best: PlannedLayout, model: ModelSpec, hardware: Hardware, seq_len: int, space, variant, against):
    """``cp comm alltoall (1.2 MiB a layer and micro-batch, 0.30x the bytes of ring; 4% of the step exposed):
    ring fits at .. but is 5% slower; ...``: each other exchange the search tries at this layout."""
    s, p = best.strategy, best.prediction
    sent = cp_bytes_per_layer(model, s, hardware, seq_len)
    head = f"cp comm {s.cp_comm} ({sent / 2**20:.3g} MiB a layer and micro-batch"
    others = [c for c in cp_comms(model, s.layout, space) if c != s.cp_comm]
    if others:
        ratios = ", ".join(
            f"{sent / cp_bytes_per_layer(model, dataclasses.replace(s, cp_comm=c), hardware, seq_len):.2f}x the "
            f"bytes of {c}"
            for c in others
        )
        head += f", {ratios}"
    head += f"; {p.cp_comm_s / p.total_s:.1%} of the step exposed)"
    if not others:
        return head + ": the only exchange searched at this layout"
    return head + ": " + "; ".join(against(c, variant(cp_comm=c)) for c in others)
