"""What modelpar's step needs for a published run's strategy, beside what the run itself got by with.

Llama 3 405B ran tp8 x pp16 x dp64 without activation recompute in 80 GB (Dubey et al. 2024, Table 4 and
section 3.3.2); the planner prices that strategy for modelpar's step and ``trainer.dry_run`` measures the same
bytes. ``published_memory`` splits modelpar's peak for such a run into:

- **sequence-parallel inputs**: each column-parallel linear under sequence parallelism (``qkv_proj`` and
  ``gate_up_proj``) keeps its input's ``[T/t, h]`` shard for the weight gradient and all-gathers it again in
  backward (``parallel.sp_keep_shard``, the default; Megatron-LM's, Korthikanti et al. 2022, section 4.2.2);
  ``sp_gathered`` is what keeping the gathered ``[T, h]`` instead (``sp_keep_shard=false``) would add;
- **in flight**: interleaved 1F1B's warm-up holds ``2(p - r - 1) + (v - 1)p + 1`` chunk micro-batches on stage
  ``r`` (``modelpar.plan.chunks.in_flight_estimate``); the paper's changes to the schedule (a tunable number of
  consecutive micro-batches per chunk, one layer fewer on the first and last stages, freeing each stage's input
  and output tensors once sent) are not modelled.

``published_note`` is the line ``modelpar-plan`` prints when asked for a published run's shape and layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.parallel.layout import ParallelLayout
from modelpar.plan.chunks import chunk_piece_counts, in_flight_mixes, strategy_partition
from modelpar.plan.memory import fullest_stage, stage_memory
from modelpar.plan.published_h100 import H100_RUNS, H100Run
from modelpar.plan.saved import dims
from modelpar.plan.spec import GIB, Hardware, ModelSpec


@dataclass(frozen=True)
class PublishedMemory:
    """modelpar's fullest stage for a published run's strategy (bytes)."""

    stage: int
    total: float
    states: float
    activations: float
    chunk_micro_batches: int  # (micro-batch, chunk) pairs the stage holds at its peak
    layers_in_flight: float  # the layers of those chunks, summed
    sp_gathered: float  # what the sequence-parallel linears' inputs would add kept gathered, not as 1/t shards

    @property
    def total_gathered(self) -> float:
        """The stage's bytes with ``parallel.sp_keep_shard=false``: the gathered inputs kept for backward."""
        return self.total + self.sp_gathered


def published_memory(run: H100Run, hardware: Hardware | None = None) -> PublishedMemory:
    """``run``'s strategy on modelpar: its fullest stage, and what keeping the sequence-parallel inputs gathered
    would add to it."""
    model, strategy, hardware = run.model, run.strategy, hardware or run.hardware
    stage = fullest_stage(model, strategy, run.seq_len, hardware)
    memory = stage_memory(model, strategy, run.seq_len, hardware, stage)
    layout = strategy.layout
    partition = strategy_partition(model, strategy, run.seq_len)
    name = strategy.schedule_name
    mix = max(in_flight_mixes(name, layout.pp, strategy.micro_batches, layout.vpp, stage), key=sum)
    x = dims(model, strategy, run.seq_len, hardware)
    halves = [
        sum(len(kind[0]) * count for kind, count in chunk_piece_counts(partition, c, model.shape.moe))
        for c in partition.chunks_of(stage)
    ]
    # one column-parallel input per half block (the shard kept, it would be the whole)
    extra_per_half = x.e * (x.T - x.Ts) * x.h if strategy.sp and strategy.sp_keep_shard else 0.0
    states = memory.weights + memory.grads + memory.optimizer + memory.buffers + memory.gathered + memory.reserved
    return PublishedMemory(
        stage=stage,
        total=memory.total,
        states=states,
        activations=memory.activations,
        chunk_micro_batches=sum(mix),
        layers_in_flight=sum(n * h / 2 for n, h in zip(mix, halves, strict=True)),
        sp_gathered=sum(n * h for n, h in zip(mix, halves, strict=True)) * extra_per_half,
    )


def matching_run(model: ModelSpec, gpus: int, seq_len: int, layout: ParallelLayout) -> H100Run | None:
    """The published run of this shape, size, sequence and tp x cp x pp x dp, if there is one."""
    for run in H100_RUNS:
        same = (run.tp, run.cp, run.pp, run.dp) == (layout.tp, layout.cp, layout.pp, layout.dp)
        if same and run.gpus == gpus and run.seq_len == seq_len and _dims(run.model) == _dims(model):
            return run
    return None


def _dims(model: ModelSpec) -> tuple:
    shape = model.shape
    fields = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "tie_embeddings")
    return tuple(getattr(shape, f) for f in fields), shape.moe.enabled


def published_note(model: ModelSpec, gpus: int, seq_len: int, layout: ParallelLayout, hardware: Hardware) -> str | None:
    """One line: the published run of this layout, its figure and memory, beside modelpar's bytes for it."""
    run = matching_run(model, gpus, seq_len, layout)
    if run is None or run.recompute != "none":
        return None
    pm = published_memory(run, hardware)
    gib = hardware.memory_bytes / GIB
    figure = f"{run.published:g} {run.figure}"
    fits = "fits" if pm.total <= hardware.memory_bytes else "does not fit"
    return (
        f"published: {run.name} ran {run.strategy.layout} with no recompute at {figure} on {gib:.0f} GiB GPUs "
        f"({run.where}); modelpar's step needs {pm.total / GIB:.1f} GiB for it at stage {pm.stage} ({fits}: "
        f"{pm.states / GIB:.1f} model states; {pm.chunk_micro_batches} chunk micro-batches, "
        f"{pm.layers_in_flight:.0f} layers, in flight under interleaved 1F1B; the dry run's saved bytes equal the "
        f"planner's), its sequence-parallel linears keeping their inputs' 1/tp shards and gathering them again in "
        f"backward ({pm.total_gathered / GIB:.1f} GiB with parallel.sp_keep_shard=false); the rest is the "
        f"schedule's warm-up, which Meta's engine trimmed (Dubey et al. 2024, 3.3.2: fewer consecutive "
        f"micro-batches per chunk, one layer fewer on the first and last stages, stage inputs and outputs freed "
        f"once sent)"
    )
