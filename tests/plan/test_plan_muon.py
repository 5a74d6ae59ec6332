"""The planner prices Muon's optimizer state (one momentum buffer for the hidden matrices instead of AdamW's two
moments) as the trainer holds it."""

from dataclasses import replace

import pytest

from modelpar.testing import run_on_ranks
from tests.helpers import make_config

LAYOUTS = [dict(), dict(tp=2), dict(dp=2, zero_=1), dict(dp=2, zero_=3), dict(pp=2)]


def _optimizer_bytes(cfg, data_path: str) -> tuple[float, float]:
    """(measured, predicted) optimizer-state bytes of this rank after one step."""
    from modelpar.bench.meters import trainer_state_bytes
    from modelpar.bench.recipe_memory import recipe_memory
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    trainer.train_step()
    measured = trainer_state_bytes(trainer)["optimizer"]
    predicted = recipe_memory(cfg)[trainer.groups.pp_rank].optimizer
    return measured, predicted


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()) or "single")
def test_planned_optimizer_state_matches_the_trainers_under_muon(token_path, tmp_path, layout):
    layout = dict(layout)
    zero = layout.pop("zero_", 0)
    out = {}
    for name in ("adamw", "muon"):
        cfg = make_config(tmp_path / name, **layout)
        cfg = replace(cfg, optim=replace(cfg.optim, name=name, zero=zero))
        world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
        out[name] = run_on_ranks(world, _optimizer_bytes, cfg, token_path)
    for (adam_measured, adam_planned), (muon_measured, muon_planned) in zip(out["adamw"], out["muon"], strict=True):
        assert muon_measured < 0.8 * adam_measured  # the hidden matrices keep half the state
        # ZeRO-1's segments cut through matrices anywhere: the planner takes Muon's share of a shard pro rata
        tolerance = 0.05 if zero == 1 else 0.01
        assert muon_planned == pytest.approx(muon_measured, rel=tolerance)
        assert adam_planned == pytest.approx(adam_measured, rel=tolerance)


def _engine_ns(cfg, data_path: str) -> tuple[list[int], int, int]:
    """The engine's Newton-Schulz FLOPs of every rank of this stage, the stage's Muon elements, and the
    elements this rank sends in a step's exchange (its updates to the owners, its results to the holders)."""
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    optimizer = trainer.optimizer.optimizer
    sizes = optimizer.route.buffer_numel()
    return optimizer.layout.ns_flops_by_rank, optimizer.layout.total, sizes["sent"] + sizes["served"]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(dp=2)], ids=["tp2", "pp2", "dp2"])
def test_planned_newton_schulz_work_is_the_engines(token_path, tmp_path, layout):
    """The planner's NS FLOPs and Muon elements per stage equal what the engine's layout runs, its exchange
    bytes are the busiest rank's (within 10%: the owners' shares are balanced by FLOPs, not elements), and the
    step prices them (AdamW: nothing)."""
    from modelpar.bench.recipe_memory import recipe_strategy
    from modelpar.plan import HARDWARE, predict
    from modelpar.plan.optimizer_step import exchange_bytes, stage_muon
    from modelpar.plan.spec import ModelSpec

    cfg = make_config(tmp_path, **layout)
    cfg = replace(cfg, optim=replace(cfg.optim, name="muon"))
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    results = run_on_ranks(world, _engine_ns, cfg, token_path)
    strategy, model = recipe_strategy(cfg), ModelSpec(cfg.model)
    flops, elements = stage_muon(model, strategy)
    for by_rank, total, _ in results:
        assert sum(by_rank) == flops and total == elements
        assert max(by_rank) <= 1.2 * flops / len(by_rank)  # the owners share the work
    if "pp" in layout:  # a stage of one rank: nothing crosses ranks
        assert exchange_bytes(model, strategy) == 0
    else:
        sent = max(r[2] for r in results) * 4.0
        assert sent == pytest.approx(exchange_bytes(model, strategy), rel=0.1)
    muon = predict(strategy, model, HARDWARE["cpu"], seq_len=cfg.data.seq_len)
    adamw = predict(replace(strategy, optimizer="adamw"), model, HARDWARE["cpu"], seq_len=cfg.data.seq_len)
    assert adamw.optimizer_s == 0 < muon.optimizer_s and muon.total_s > adamw.total_s
