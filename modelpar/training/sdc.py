"""Silent data corruption: rerun one micro-batch and compare, bit for bit, what every rank computed.

A failing device (a flaky multiplier, a bad memory cell) returns wrong numbers without an error, and the
all-reduce then spreads them into every replica. Every ``trainer.sdc_check_every`` steps each rank records
a checksum of the bits of every module output and of every parameter gradient its first micro-batch
produced, then runs that micro-batch again (forward and backward, through the same pipeline, with the loss
scaled as in the step) and compares. The computation is deterministic (on GPU under
``torch.use_deterministic_algorithms``), so any difference is corruption.

The rank named is the first to differ in the order the values were computed: forwards stage by stage,
then backwards from the last stage; within a stage, tensor-parallel ranks agree until a collective mixes
their values, so the rank whose own value went wrong differs first. Data-parallel replicas are independent
until the gradients are reduced, except those whose experts exchange tokens over ep: each such unit names
its own first rank. The verdict is gathered over the world
and is the same on every rank: halt, skip the step's update, or warn (``trainer.sdc_action``).

Cost: one micro-batch's forward and backward, plus a sum per recorded tensor, on check steps only; the
hooks are attached for those steps and removed after.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from modelpar.parallel.groups import ParallelGroups
from modelpar.pipeline import PipelineRuntime
from modelpar.pipeline.actions import F

SDC_ACTIONS = ("halt", "skip", "warn")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_checksum(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 on ``t``'s device that changes when any single bit of ``t`` does (sum of its bit
    patterns read as integers, wrapping)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(_INT_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64)


class _Recording:
    """Checksums of the first micro-batch's values on this rank, keyed by where they were computed."""

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.names: list[str] = []
        self.sums: list[torch.Tensor] = []
        self.counts: dict[tuple, int] = {}

    def add(self, phase: tuple, name: str, value: torch.Tensor) -> None:
        n = self.counts.get(phase, 0)
        self.counts[phase] = n + 1
        self.keys.append((*phase, n))
        self.names.append(name)
        self.sums.append(bit_checksum(value))


class SilentCorruptionCheck:
    """Attach with ``arm()`` before a check step's pipeline run; ``rerun(inputs, targets)`` after the
    gradients are reduced, with the step's first micro-batch. Returns None or the message naming the rank."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        params: Sequence[torch.nn.Parameter],
        groups: ParallelGroups,
        step_runtime: PipelineRuntime,
        rerun_runtime: PipelineRuntime,
    ):
        self.chunks, self.params, self.groups = list(chunks), list(params), groups
        self.step_runtime, self.rerun_runtime = step_runtime, rerun_runtime
        self._names = {id(m): name for c in self.chunks for name, m in c.named_modules()}
        self._param_names = {id(p): n for c in self.chunks for n, p in c.named_parameters()}
        self._handles: list = []
        self._recording: _Recording | None = None
        self._runtime: PipelineRuntime | None = None

    # -- recording -----------------------------------------------------------------------------------------

    def arm(self) -> None:
        self._start(self.step_runtime)
        for chunk in self.chunks:
            for module in chunk.modules():
                self._handles.append(module.register_forward_hook(self._on_output))
        for p in self.params:
            self._handles.append(p.register_hook(self._gradient_hook(p)))

    def _start(self, runtime: PipelineRuntime) -> None:
        self._recording, self._runtime = _Recording(), runtime

    def _phase(self) -> tuple | None:
        """Where in the order of computation we are, or None outside the first micro-batch."""
        action = self._runtime.current if self._runtime is not None else None
        if action is None or action.micro_batch != 0 or self._recording is None:
            return None
        stage = action.stage(self.groups.layout.pp, self._runtime.placement)
        return (0, stage) if action.kind is F else (1, -stage, action.kind.value)

    def _on_output(self, module, args, output) -> None:
        phase = self._phase()
        if phase is None:
            return
        for i, value in enumerate(output if isinstance(output, tuple | list) else (output,)):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                self._recording.add(phase, f"{self._names.get(id(module), '?')} output {i}", value)

    def _gradient_hook(self, p: torch.nn.Parameter):
        name = self._param_names.get(id(p), "?")

        def hook(grad: torch.Tensor) -> None:
            phase = self._phase()
            if phase is not None:
                self._recording.add(phase, f"gradient of {name}", grad)

        return hook

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._recording = self._runtime = None

    # -- the rerun and the verdict -------------------------------------------------------------------------

    def rerun(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, step: int) -> str | None:
        """Run the first micro-batch again and compare; collective over the world. The step's gradients are
        put back untouched."""
        first = self._recording
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            self._start(self.rerun_runtime)
            self.rerun_runtime.step(
                [inputs] if inputs is not None else None, [targets] if targets is not None else None
            )
            second = self._recording
        finally:
            for p, grad in zip(self.params, saved, strict=True):
                p.grad = grad
            self.disarm()
        local = _first_difference(first, second)
        found: list = [None] * dist.get_world_size() if dist.is_initialized() else [None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_gather_object(found, local)
        else:
            found = [local]
        return self._verdict(found, step)

    def _verdict(self, found: list, step: int) -> str | None:
        differing = [(r, f) for r, f in enumerate(found) if f is not None]
        if not differing:
            return None
        g = self.groups
        unit = _independent_units(g.layout)
        by_replica: dict[int, list] = {}
        for r, f in differing:
            by_replica.setdefault(unit[r], []).append((r, f))
        named = []
        for replica in sorted(by_replica):
            ranks = by_replica[replica]
            r, (key, what) = min(ranks, key=lambda item: item[1][0])
            c = g.layout.coords(r)
            others = sorted(o for o, _ in ranks if o != r)
            also = f"; ranks {', '.join(map(str, others))} differ downstream of it" if others else ""
            named.append(f"rank {r} (pp {c.pp} tp {c.tp} dp {c.dp}) computed a different {what}{also}")
        return (
            f"silent data corruption at step {step}: rerunning the first micro-batch, "
            + " | ".join(named)
            + "; check that device"
        )


def _independent_units(layout) -> list[int]:
    """Per rank, a label shared by the ranks whose values mix before the gradients are reduced: one dp replica
    (its tp, cp and pp ranks), joined with the replicas it exchanges tokens with over ep. A corruption spreads
    inside its unit only, so each unit names its own first differing rank."""
    parent = list(range(layout.world_size))

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    first_of_replica: dict[int, int] = {}
    for r in range(layout.world_size):
        parent[find(r)] = find(first_of_replica.setdefault(layout.coords(r).dp, r))
    for group in layout.all_ep_groups() if layout.ep > 1 else []:
        for r in group[1:]:
            parent[find(r)] = find(group[0])
    return [find(r) for r in range(layout.world_size)]


def _first_difference(first: _Recording | None, second: _Recording | None) -> tuple | None:
    """(order key, description) of the earliest value that differs between the two runs, or None."""
    if first is None or second is None:
        return None
    if first.keys != second.keys:
        return ((-1,), "sequence of computations (the rerun took another path)")
    if not first.sums:
        return None
    a, b = torch.stack(first.sums), torch.stack(second.sums)
    differs = (a != b).nonzero().flatten().tolist()  # one read-back, on check steps only
    if not differs:
        return None
    order = sorted(differs, key=lambda i: first.keys[i])
    i = order[0]
    return (first.keys[i], first.names[i])


__all__ = ["SDC_ACTIONS", "SilentCorruptionCheck", "bit_checksum"]
