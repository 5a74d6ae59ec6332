"""Why the chosen strategy runs its ZeRO stage, recompute and offload: the same strategy predicted with that one
choice changed, and what would not fit or would be slower."""

from __future__ import annotations

import dataclasses

from modelpar.plan.activations import offloaded_per_micro_batch
from modelpar.plan.search import SearchSpace, zero_stages
from modelpar.plan.spec import GIB, CostModel, Hardware, ModelSpec, PlannedLayout, Prediction
from modelpar.plan.step_time import offload_per_micro_batch_s, predict


def explain(
    best: PlannedLayout,
    model: ModelSpec,
    hardware: Hardware,
    *,
    seq_len: int,
    costs: CostModel | None = None,
    space: SearchSpace | None = None,
) -> list[str]:
    """Why the chosen strategy runs its ZeRO stage, recompute and offload: one line each, from predicting the
    same strategy with that one choice changed (what would not fit, and what would be slower)."""
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
    stages = [z for z in zero_stages(model, s.layout, space) if z != s.zero]
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
    return [f"why {zero}", f"why {recompute}", f"why {offload}"]
