"""DualPipeV's overlapped pairs: two micro-batches take turns at each posted all-to-all, and compute exactly
what the same schedule computes one action after the other."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

import pytest
import torch
from torch import nn

from modelpar import ParallelLayout
from modelpar.parallel.experts import ExpertParallelGroup, all_to_all_tokens
from modelpar.parallel.handoff import Pair, while_in_flight
from modelpar.parallel.regions import TensorParallelGroup, column_parallel_matmul, reduce_from_tp_region
from modelpar.pipeline.partition import partition_uniform
from modelpar.pipeline.runtime import PipelineRuntime
from modelpar.pipeline.schedule import build_schedule, placement_for
from modelpar.pipeline.schedule_v import pair_proof
from modelpar.pipeline.simulate import check_schedule
from modelpar.testing import current_groups, run_on_ranks
from tests.pipeline import toy_model
from tests.pipeline.toy_model import ToyConfig


def test_the_two_sides_take_turns_at_each_hand_over_and_the_first_starts():
    seen = []

    def side(name):
        def run():
            for step in range(3):
                seen.append(f"{name}{step}")
                while_in_flight()

        return run

    turns = []
    pair = Pair(on_turn=turns.append)
    pair.run(side("F"), side("B"))
    assert seen == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert pair.handovers == 6  # F's last hands to B, B's last back to F (still inside it); none finds a side done
    assert turns[:3] == [0, 1, 0]
    while_in_flight()  # outside a pair: nothing to hand over to


def test_a_side_that_fails_lets_the_other_finish_and_the_error_reaches_the_caller():
    finished = []

    def failing():
        while_in_flight()
        raise ValueError("boom")

    def other():
        while_in_flight()
        while_in_flight()
        finished.append(True)

    with pytest.raises(ValueError, match="boom"):
        Pair().run(failing, other)
    assert finished == [True]


def test_the_helper_thread_gets_the_callers_grad_mode():
    modes = {}

    def record(name):
        return lambda: modes.setdefault(name, (torch.is_grad_enabled(), threading.current_thread().name))

    with torch.no_grad():
        Pair().run(record("F"), record("B"))
    assert modes["F"] == (False, "pair-forward") and modes["B"][0] is False


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_every_dualpipev_pair_is_proven_with_its_transfers_posted_after_the_backward(pp):
    for m in range(pp, 4 * pp + 1):
        schedule = build_schedule("dualpipev", pp, m, 2)
        check_schedule(pair_proof(schedule))
        for forward, backward in schedule.pairs:
            row = schedule[forward.rank]
            computes = [a for a in row if a.kind.is_compute]
            assert computes[computes.index(forward) + 1] == backward
            assert forward.micro_batch != backward.micro_batch
    assert len(build_schedule("dualpipev", pp, 4 * pp, 2).pairs) > 0
    assert not build_schedule("zbv", pp, 4 * pp, 2).pairs


class _Exchange(nn.Module):
    """Half the rows of x [b, s, h] go to the other ep rank, through a matmul there, and come back: two
    all-to-alls in forward and two in backward, like a MoE layer's dispatch and combine."""

    def __init__(self, hidden: int, ep: ExpertParallelGroup):
        super().__init__()
        self.ep = ep
        torch.manual_seed(7)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        splits = [n // self.ep.size] * self.ep.size  # even: the rows received are as many as those sent
        gathered = all_to_all_tokens(rows, splits, splits, self.ep)
        out = all_to_all_tokens(torch.tanh(self.proj(gathered)), splits, splits, self.ep)
        return x + out.reshape(x.shape)


class _TensorParallel(nn.Module):
    """A column-parallel then a row-parallel matmul over the group (a tp=2 MLP's collectives): an all-reduce in
    forward (the row-parallel sum) and one in backward (the column-parallel input's gradient)."""

    def __init__(self, hidden: int, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        torch.manual_seed(7)
        self.up = nn.Linear(hidden, hidden, bias=False)
        self.down = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        inner = torch.tanh(column_parallel_matmul(x, self.up.weight, self.tp))
        return x + reduce_from_tp_region(self.down(inner), self.tp)


def _with_exchange(chunk: nn.Sequential, exchange: nn.Module) -> nn.Sequential:
    """The chunk with ``exchange`` after its blocks (before the head, if it holds it)."""
    layers = list(chunk.named_children())
    at = len(layers) - (layers[-1][0] == "head")
    return nn.Sequential(OrderedDict([*layers[:at], ("exchange", exchange), *layers[at:]]))


def _step(cfg: ToyConfig, m: int, overlap: bool, exchange: str = "all_to_all"):
    groups = current_groups()
    partition = replace(partition_uniform(cfg.layers, groups.layout.pp, 2), placement=placement_for("dualpipev"))
    chunks = toy_model.chunk_modules(cfg, partition, groups.pp_rank)
    if exchange == "all_to_all":  # the dp group as an ep group
        ep = ExpertParallelGroup(group=groups.dp_group, rank=groups.dp_rank, size=groups.layout.dp)
        chunks = [_with_exchange(c, _Exchange(cfg.hidden, ep)) for c in chunks]
    else:
        chunks = [_with_exchange(c, _TensorParallel(cfg.hidden, TensorParallelGroup.of(groups))) for c in chunks]
    runtime = PipelineRuntime(
        chunks,
        groups,
        build_schedule("dualpipev", groups.layout.pp, m, 2),
        activation_shape=(cfg.batch, cfg.seq, cfg.hidden),
        loss_fn=toy_model.loss_fn,
    )
    runtime.overlap_pairs = overlap
    tokens, targets = toy_model.batch(cfg, m)
    tokens, targets = tokens + groups.dp_rank, targets  # each dp rank its own batch (tp ranks share theirs)
    tokens = tokens % cfg.vocab
    result = runtime.step(tokens, targets)
    grads = {n: p.grad.clone() for c in chunks for n, p in c.named_parameters()}
    return result.loss, grads, runtime.pair_handovers, len(runtime.pairs)


@pytest.mark.parametrize("exchange", ["all_to_all", "all_reduce"])
def test_pairs_at_once_compute_bit_for_bit_what_they_compute_in_order(exchange):
    cfg, m = ToyConfig(layers=4, batch=4), 8  # 20 rows a micro-batch, 10 to each ep rank
    layout = ParallelLayout(pp=2, dp=2) if exchange == "all_to_all" else ParallelLayout(pp=2, tp=2)
    ordered = run_on_ranks(4, _step, cfg, m, False, exchange, layout=layout)
    at_once = run_on_ranks(4, _step, cfg, m, True, exchange, layout=layout)
    for (loss_a, grads_a, handed_a, pairs), (loss_b, grads_b, handed_b, _) in zip(ordered, at_once, strict=True):
        assert pairs > 0 and handed_a == 0 and handed_b > 0  # the pairs really took turns
        assert loss_a == loss_b
        assert grads_a.keys() == grads_b.keys()
        for name, grad in grads_a.items():
            assert torch.equal(grad, grads_b[name]), name
