"""Profiler traces of chosen steps: ``trainer.profile_steps=[a, b]`` records steps ``a..b`` (as logged, from 1).

Each rank writes one Chrome trace (``<out_dir>/profile/rank-00003.json``), viewable in Perfetto
(ui.perfetto.dev) or TensorBoard, with CPU activity (and CUDA kernels on a GPU) and input shapes. The pipeline
runtime and the collectives name their work in it while a profiler records (``collectives.profiler_range``)::

    step 2
      1F0              pipeline rank 1's forward of micro-batch 0     (1B0, 1W0c1: rank, kind, micro-batch, chunk)
      1SEND_F0         posting a p2p batch of those actions           wait 1RECV_B0: waiting for one
      all_reduce:layer a collective, with its ``comm_tag``

With ``trainer.memory_snapshot=true`` on CUDA, the allocator's history over the same steps is dumped too
(``rank-00003-memory.pickle``, the format of pytorch.org/memory_viz).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from modelpar.training.config import TrainConfig

# allocation events kept for a memory snapshot: enough for several steps of a large model
_MEMORY_EVENTS = 100_000


class StepProfiler:
    """Records steps ``first..last`` of this rank; the loop calls :meth:`starting` and :meth:`finished`."""

    def __init__(self, first: int, last: int, out_dir: Path, rank: int, device: torch.device, memory: bool):
        self.first, self.last = first, last
        self.folder = Path(out_dir) / "profile"
        self.rank, self.device = rank, device
        self.memory = memory and device.type == "cuda"
        self.profiler: profile | None = None
        self.step_range: record_function | None = None

    @classmethod
    def of(cls, cfg: TrainConfig, out_dir: Path, rank: int, device: torch.device) -> StepProfiler:
        """The recipe's profiler (without ``trainer.profile_steps`` one that records nothing: steps count from 1)."""
        t = cfg.trainer
        first, last = t.profile_steps or (0, 0)
        return cls(first, last, out_dir, rank, device, t.memory_snapshot)

    @property
    def trace_path(self) -> Path:
        return self.folder / f"rank-{self.rank:05d}.json"

    @property
    def memory_path(self) -> Path:
        return self.folder / f"rank-{self.rank:05d}-memory.pickle"

    def starting(self, step: int) -> None:
        """Step ``step`` (from 1) is about to run."""
        if step == self.first:
            activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (self.device.type == "cuda")
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=_MEMORY_EVENTS)
            self.profiler = profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()
        if self.profiler is not None:
            self.step_range = record_function(f"step {step}")
            self.step_range.__enter__()

    def finished(self, step: int) -> None:
        """Step ``step`` has run; after the last one, the trace (and snapshot) are written."""
        if self.profiler is None:
            return
        self.step_range.__exit__(None, None, None)
        self.step_range = None
        if step == self.last:
            self._write()

    def _write(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels of the last step belong in the trace
        self.profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.trace_path))
        self.profiler = None
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.memory_path))
            torch.cuda.memory._record_memory_history(enabled=None)

    def close(self) -> None:
        """Stop recording without writing (the run ended before the last profiled step)."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
            if self.memory:
                torch.cuda.memory._record_memory_history(enabled=None)
