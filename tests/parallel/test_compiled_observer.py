"""A collective inside a compiled block is not reported to the observer: its clock would break the graph, and
Dynamo would warn once per rank (``model.compile=true`` at tp > 1)."""

from __future__ import annotations

import time
import warnings

import torch

from modelpar.parallel import collectives
from modelpar.testing import run_on_ranks


class _ClockObserver:
    def wait(self, label: str) -> None:
        self.since = time.time()

    def done_waiting(self) -> None:
        pass


def _block(x):
    with collectives.blocking("all_reduce", None):
        y = x * 2
    return y + 1


def _compile_with_an_observer() -> list[str]:
    collectives.set_collective_observer(_ClockObserver())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = torch.compile(_block, backend="eager")(torch.ones(3))
    finally:
        collectives.set_collective_observer(None)
    assert torch.equal(out, torch.full((3,), 3.0))
    return [str(w.message).splitlines()[0] for w in caught]


def test_a_compiled_collective_block_compiles_without_graph_break_warnings():
    (messages,) = run_on_ranks(1, _compile_with_an_observer)
    assert not [m for m in messages if "Dynamo" in m], messages
