"""``model.compile=true``: each transformer block under ``torch.compile``, compiled in place.

    compilation = compile_blocks(chunks)      # before the first step; logs once, after the first step's compiles

Blocks are compiled one by one (``Block.compile()``), not the chunk: every block is the same program, so
inductor compiles it once and the other blocks reuse the code (parameters are graph inputs), and the
module tree is untouched, so parameter names, state dicts, ``logical_shards`` and optimizer state are exactly
those of the eager model. The embedding, final norm, head and loss stay eager; the vocab-parallel loss and the
Triton kernels are already fused.

Under tensor parallelism a block calls the autograd Functions of ``modelpar.parallel.regions``; their forward
touches the comm-tag and recording state of ``modelpar.parallel.collectives`` (a side effect Dynamo refuses
inside an autograd Function), so Dynamo breaks the graph there and runs them eagerly: each block becomes a few
compiled pieces between its collectives (8 graphs for a tp=2 model), which are still issued, counted
(``record_comm``) and observed exactly as in eager mode.

Compilation is lazy: the forward graphs compile in the first forward, the backward graphs in the first backward.
The time spent compiling (as Dynamo reports it, process-wide) is summed from then on and reported once, as
``torch.compile: compiled 16 blocks in 41.2 s (first step)``, at the first forward of a chunk after a backward
has run through it, i.e. when the next micro-batch or step begins. On a GPU this is the first step's extra time; it is
not spent again unless shapes change (a shorter last batch recompiles once, with dynamic shapes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from modelpar.model.transformer import ModelChunk

if TYPE_CHECKING:
    from torch._dynamo.callback import CallbackArgs

log = logging.getLogger(__name__)


class BlockCompilation:
    """What ``compile_blocks`` compiled, and the time spent compiling until the first step's report.

    ``compile_s`` sums every Dynamo and lazy-backward compile of the process from ``compile_blocks`` until the
    report (other ``torch.compile`` users included); ``graphs`` counts those compiles (forward and backward
    pieces, recompiles; none when this process already compiled the same blocks). Both stay fixed once
    ``reported``.
    """

    def __init__(self, chunks: list[ModelChunk], blocks: int, report: Callable[[str], None]):
        self.blocks = blocks
        self.compile_s = 0.0
        self.graphs = 0
        self.reported = False
        self._report = report
        self._backward_seen = False
        self._started: float | None = None
        self._lock = threading.Lock()  # backward compiles run on autograd's threads
        # Dynamo loads here, not at import: two seconds of start-up that runs without model.compile never use
        from torch._dynamo.callback import callback_handler

        self._callbacks = callback_handler
        callback_handler.register_start_callback(self._compile_started)
        callback_handler.register_end_callback(self._compile_ended)
        self._hooks = [chunk.register_forward_pre_hook(self._before_forward) for chunk in chunks]
        self._hooks += [chunk.register_forward_hook(self._after_forward) for chunk in chunks]

    def summary(self) -> str:
        return f"torch.compile: compiled {self.blocks} blocks in {self.compile_s:.1f} s (first step)"

    def _compile_started(self, args: CallbackArgs) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def _compile_ended(self, args: CallbackArgs) -> None:
        with self._lock:
            if self._started is not None:
                self.compile_s += time.perf_counter() - self._started
                self._started = None
            self.graphs += 1

    def _after_forward(self, chunk: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        # the chunk's backward starts when its output's gradient arrives; by the next forward it has finished
        if not self._backward_seen and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(self._saw_backward)

    def _saw_backward(self, grad: torch.Tensor) -> None:
        self._backward_seen = True

    def _before_forward(self, chunk: torch.nn.Module, args: tuple) -> None:
        if self._backward_seen and not self.reported:
            self.reported = True
            self._callbacks.remove_start_callback(self._compile_started)
            self._callbacks.remove_end_callback(self._compile_ended)
            for handle in self._hooks:
                handle.remove()
            self._report(self.summary())


def compile_blocks(
    chunks: ModelChunk | Iterable[ModelChunk], *, report: Callable[[str], None] | None = None, **options
) -> BlockCompilation:
    """Put every ``Block`` of ``chunks`` (one chunk, or all of this rank's) under ``torch.compile``, in place.

    ``options`` go to ``torch.compile`` (``mode="max-autotune"``, ``dynamic=False``, ``backend=...``).
    ``report`` receives the one compile-time line after the first step's compiles (default: ``logging`` at
    INFO on this module's logger). Call before the first forward; parameters are not touched.
    """
    chunks = [chunks] if isinstance(chunks, ModelChunk) else list(chunks)
    blocks = [block for chunk in chunks for block in chunk.layers.values()]
    for block in blocks:
        block.compile(**options)
    return BlockCompilation(chunks, len(blocks), report or log.info)
