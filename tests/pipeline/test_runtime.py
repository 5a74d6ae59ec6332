"""The runtime on emulated ranks: every schedule gives the single-device loss and gradients, and holds
exactly as many micro-batches in flight as the simulator predicts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from modelpar import ParallelLayout
from modelpar.pipeline.actions import Action
from modelpar.pipeline.partition import partition_uniform
from modelpar.pipeline.runtime import PipelineRuntime, measured_timeline
from modelpar.pipeline.schedule import SCHEDULES, V_SCHEDULES, ScheduleError, build_schedule, placement_for
from modelpar.pipeline.simulate import simulate
from modelpar.testing import current_groups, run_on_ranks
from tests.pipeline import toy_model
from tests.pipeline.toy_model import ToyConfig

CFG = ToyConfig()
RTOL = 1e-5
LAYOUT_2 = ParallelLayout(pp=2)


def vpp_of(schedule: str) -> int:
    return 2 if schedule in ("interleaved", *V_SCHEDULES) else 1


def placed(schedule: str, layers: int, pp: int):
    """The uniform layer split, its chunks placed on ranks as ``schedule`` places them."""
    return replace(partition_uniform(layers, pp, vpp_of(schedule)), placement=placement_for(schedule))


def cases(pp: int) -> list[tuple[str, int]]:
    return [(name, m) for name in SCHEDULES for m in sorted({pp, 2 * pp, 5})]


def _run_cases(cfg: ToyConfig, todo: list[tuple[str, int]]) -> dict:
    """On each rank, one step per (schedule, m): what it produced, or the rejection message."""
    groups = current_groups()
    pp, out = groups.layout.pp, {}
    for name, m in todo:
        try:
            schedule = build_schedule(name, pp, m, vpp_of(name))
        except ScheduleError as exc:
            out[(name, m)] = {"rejected": str(exc)}
            continue
        chunks = toy_model.chunk_modules(cfg, placed(name, cfg.layers, pp), groups.pp_rank)
        runtime = PipelineRuntime(
            chunks, groups, schedule, activation_shape=(cfg.batch, cfg.seq, cfg.hidden), loss_fn=toy_model.loss_fn
        )
        runtime.timing = True  # per-action records are opt-in
        accumulations = toy_model.count_accumulations(chunks)
        result = runtime.step(*toy_model.batch(cfg, m))
        out[(name, m)] = {
            "loss": result.loss,
            "grads": toy_model.named_grads(chunks),
            "result": result,
            "accumulations": dict(accumulations),
        }
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """All cases for pp=2 and pp=4, one ``run_on_ranks`` call each (pool start-up dominates the cost)."""
    return {pp: run_on_ranks(pp, _run_cases, CFG, cases(pp), layout=ParallelLayout(pp=pp)) for pp in (2, 4)}


def ran_cases() -> list[tuple[str, int, int]]:
    return [(name, pp, m) for pp in (2, 4) for name, m in cases(pp) if not (name == "interleaved" and m % pp)]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).norm() / want.norm().clamp_min(1e-12)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL:g}"


@pytest.mark.parametrize("name, pp, m", ran_cases(), ids=lambda v: str(v))
def test_loss_and_gradients_equal_the_single_device_model(runs, name, pp, m):
    want_loss, want_grads = toy_model.reference(CFG, m)
    seen: set[str] = set()
    for rank, per_rank in enumerate(runs[pp]):
        case = per_rank[(name, m)]
        assert "rejected" not in case, f"{name} pp={pp} m={m} rank {rank}: {case.get('rejected')}"
        loss, grads = case["loss"], case["grads"]
        assert abs(loss - want_loss) <= RTOL * abs(want_loss), f"{name} pp={pp} m={m} rank {rank}: loss {loss}"
        for param, grad in grads.items():
            assert_close(grad, want_grads[param], f"{name} pp={pp} m={m} rank {rank} grad of {param}")
        seen |= grads.keys()
    assert seen == want_grads.keys(), f"{name} pp={pp} m={m}: parameters missing {want_grads.keys() - seen}"


@pytest.mark.parametrize("name, pp, m", ran_cases(), ids=lambda v: str(v))
def test_measured_peak_in_flight_equals_the_simulated_one(runs, name, pp, m):
    predicted = simulate(build_schedule(name, pp, m, vpp_of(name))).peak_in_flight
    measured = tuple(per_rank[(name, m)]["result"].peak_in_flight for per_rank in runs[pp])
    assert measured == predicted, f"{name} pp={pp} m={m}: measured {measured}, simulated {predicted}"


@pytest.mark.parametrize("name, pp, m", ran_cases(), ids=lambda v: str(v))
def test_every_parameter_accumulates_once_per_micro_batch_through_autograd(runs, name, pp, m):
    """Data-parallel overlap counts post-accumulate-grad hooks; split backwards must fire them too."""
    for rank, per_rank in enumerate(runs[pp]):
        counts = per_rank[(name, m)]["accumulations"]
        assert counts and set(counts.values()) == {m}, f"{name} pp={pp} m={m} rank {rank}: {counts}"


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_rejects_a_micro_batch_count_pp_does_not_divide(runs, pp):
    message = runs[pp][0][("interleaved", 5)]["rejected"]
    assert "multiple of pp" in message and "\n" not in message, message


def test_records_cover_every_action_in_order_on_a_shared_clock(runs):
    results = [per_rank[("1f1b", 8)]["result"] for per_rank in runs[4]]
    schedule = build_schedule("1f1b", 4, 8)
    for rank, result in enumerate(results):
        assert [t.action for t in result.records] == schedule[rank]
        starts = [t.start for t in result.records]
        assert starts == sorted(starts) and all(t.end >= t.start for t in result.records)
    timeline = measured_timeline(results)
    assert 0.0 <= timeline.bubble_fraction < 1.0
    first_backward_on_last = next(t for t in results[3].records if t.action.kind.value == "B")
    first_forward_on_first = results[0].records[0]
    assert first_forward_on_first.end <= first_backward_on_last.start  # causality across ranks


def _run_with_tp(cfg: ToyConfig, name: str, m: int) -> tuple[float, dict]:
    groups = current_groups()
    chunks = toy_model.chunk_modules(cfg, partition_uniform(cfg.layers, groups.layout.pp), groups.pp_rank)
    runtime = PipelineRuntime(
        chunks,
        groups,
        build_schedule(name, groups.layout.pp, m),
        activation_shape=(cfg.batch, cfg.seq, cfg.hidden),
        loss_fn=toy_model.loss_fn,
    )
    tokens, targets = toy_model.batch(cfg, m)
    result = runtime.step(tokens, targets)
    return result.loss, toy_model.named_grads(chunks)


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, pp=2), ParallelLayout(pp=2, dp=2)], ids=str)
def test_every_tp_and_dp_replica_of_a_stage_runs_its_own_pipeline(layout):
    want_loss, want_grads = toy_model.reference(CFG, 4)
    for rank, (loss, grads) in enumerate(run_on_ranks(4, _run_with_tp, CFG, "zb-h1", 4, layout=layout)):
        assert abs(loss - want_loss) <= RTOL * abs(want_loss), f"rank {rank}: loss {loss}"
        for param, grad in grads.items():
            assert_close(grad, want_grads[param], f"{layout} rank {rank} grad of {param}")


def _construction_errors(cfg: ToyConfig) -> list[str]:
    """Messages from runtimes built wrongly, collected on each rank (nothing is sent)."""
    groups = current_groups()
    chunks = toy_model.chunk_modules(cfg, partition_uniform(cfg.layers, 2), groups.pp_rank)
    shape = (cfg.batch, cfg.seq, cfg.hidden)
    broken = build_schedule("1f1b", 2, 1)
    broken[0].append(broken[0].pop(broken[0].index(Action.parse("0SEND_F0"))))  # sent only after its reply
    attempts = [
        lambda: PipelineRuntime(chunks, groups, broken, activation_shape=shape, loss_fn=toy_model.loss_fn),
        lambda: PipelineRuntime(
            chunks, groups, build_schedule("interleaved", 2, 2, 2), activation_shape=shape, loss_fn=toy_model.loss_fn
        ),
        lambda: PipelineRuntime(
            chunks, groups, build_schedule("1f1b", 2, 3), activation_shape=shape, loss_fn=toy_model.loss_fn
        ).step(*toy_model.batch(cfg, 2)),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (ScheduleError, ValueError) as exc:
            messages.append(str(exc).splitlines()[0])
    return messages


def test_runtime_refuses_bad_schedules_and_batches_before_sending_anything():
    for rank, (deadlock, chunks, count) in enumerate(run_on_ranks(2, _construction_errors, CFG, layout=LAYOUT_2)):
        assert deadlock.startswith("schedule deadlocks"), f"rank {rank}: {deadlock}"
        assert "schedule uses 2 chunks per rank but rank" in chunks, f"rank {rank}: {chunks}"
        assert "has 2 micro-batches; the schedule runs 3" in count, f"rank {rank}: {count}"


def _forward_only(cfg: ToyConfig, todo: list[tuple[str, int]]) -> dict:
    from modelpar.pipeline import forward_only

    groups = current_groups()
    pp, out = groups.layout.pp, {}
    for name, m in todo:
        chunks = toy_model.chunk_modules(cfg, placed(name, cfg.layers, pp), groups.pp_rank)
        runtime = PipelineRuntime(
            chunks,
            groups,
            forward_only(name, pp, m, vpp_of(name)),
            activation_shape=(cfg.batch, cfg.seq, cfg.hidden),
            loss_fn=toy_model.loss_fn,
        )
        runtime.timing = True  # per-action records are opt-in
        result = runtime.step(*toy_model.batch(cfg, m))
        grads = [p.grad for c in chunks for p in c.parameters()]
        out[(name, m)] = (result.loss, result.peak_in_flight, all(g is None for g in grads), len(result.records))
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_forward_only_schedules_give_the_single_device_loss_and_keep_nothing(pp):
    todo = [(name, m) for name, m in cases(pp) if not (name == "interleaved" and m % pp)]
    per_rank = run_on_ranks(pp, _forward_only, CFG, todo, layout=ParallelLayout(pp=pp))
    for name, m in todo:
        want_loss, _ = toy_model.reference(CFG, m)
        for rank, out in enumerate(per_rank):
            loss, peak, no_grads, actions = out[(name, m)]
            assert abs(loss - want_loss) <= RTOL * abs(want_loss), f"{name} pp={pp} m={m} rank {rank}: {loss}"
            assert peak == 0 and no_grads, f"{name} pp={pp} m={m} rank {rank}: held {peak}, grads set"
            assert actions > 0
