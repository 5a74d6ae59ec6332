"""The planner with mixtures of experts: ep enumerated, expert memory divided by ep, all-to-alls costed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from modelpar.parallel.layout import ParallelLayout
from modelpar.plan import SearchSpace, Strategy, load_hardware, load_model, plan, predict, stage_params, valid_layouts

H100 = load_hardware("h100-80gb")


@pytest.fixture(scope="module")
def mixtral():
    return load_model("mixtral-8x7b")


def test_expert_memory_is_divided_by_ep_and_not_by_tp(mixtral):
    expert = 3 * 4096 * 14336  # one expert of one layer
    one, eight = (stage_params(mixtral, ParallelLayout(tp=2, pp=4, dp=8, ep=ep), 1) for ep in (1, 8))
    assert one - eight == pytest.approx(8 * (8 - 1) * expert, rel=1e-9)  # 8 layers on a stage, 7 experts fewer
    tp4 = stage_params(mixtral, ParallelLayout(tp=4, pp=4, dp=4, ep=4), 1)
    assert tp4 > stage_params(mixtral, ParallelLayout(tp=2, pp=4, dp=8, ep=8), 1)  # tp does not split experts


def test_ep_is_enumerated_for_moe_models_only(mixtral):
    layouts = valid_layouts(mixtral, 16, 64, SearchSpace(cp=1))
    assert {layout.ep for layout in layouts} == {1, 2, 4, 8}
    assert all((layout.dp * layout.cp) % layout.ep == 0 for layout in layouts)
    dense = replace(mixtral, shape=replace(mixtral.shape, moe=replace(mixtral.shape.moe, experts=0)))
    assert {layout.ep for layout in valid_layouts(dense, 16, 64, SearchSpace(cp=1))} == {1}


def test_all_to_alls_cost_time_at_ep_above_one_and_flops_count_active_experts(mixtral):
    def run(ep, recompute="none"):
        strategy = Strategy(ParallelLayout(tp=2, pp=4, dp=8, ep=ep), 1, 32, recompute, 0, True)
        return predict(strategy, mixtral, H100, seq_len=4096)

    assert run(1).ep_comm_s == 0 < run(8).ep_comm_s < run(8, "full").ep_comm_s
    active = mixtral.shape.matmul_params()
    assert 12.5e9 < active < 13.0e9  # Mixtral's 12.9B active parameters less the 0.13B embedding lookup
    assert run(8).model_flops_per_step == pytest.approx((6 * active + 12 * 32 * 4096 * 4096) * 256 * 4096, rel=1e-9)


def test_zero0_expert_gradients_are_reduced_over_the_ranks_holding_the_same_experts(mixtral):
    from modelpar.plan.dp_time import dp_exposed_s
    from modelpar.plan.links import ring_all_reduce_s
    from modelpar.plan.spec import CostModel

    costs, bw, lat = CostModel(), H100.inter_node_bw, H100.latency_s
    expert = 3 * 4096 * 14336

    def exposed(dp, ep):
        layout = ParallelLayout(tp=2, pp=4, dp=dp, ep=ep)
        return dp_exposed_s(mixtral, Strategy(layout, 1, 32, "none", 0, True), H100, costs), layout

    def all_reduce(params, n):
        return ring_all_reduce_s(params * 4, n, bw, lat)

    full, layout = exposed(8, 1)  # every rank holds every expert: one all-reduce over dp 8
    params = max(stage_params(mixtral, layout, s) for s in (0, 3))
    assert full == pytest.approx((1 - costs.dp_overlap) * all_reduce(params, 8), rel=1e-9)
    whole, layout = exposed(8, 8)  # each expert on one rank of the dp group: only the rest is reduced
    rest = max(stage_params(mixtral, layout, s) for s in (0, 3)) - 8 * expert
    assert whole == pytest.approx((1 - costs.dp_overlap) * all_reduce(rest, 8), rel=1e-9)
    half, layout = exposed(8, 4)  # 2 experts a rank, each on 2 ranks: reduced over those 2
    rest = max(stage_params(mixtral, layout, s) for s in (0, 3)) - 8 * 2 * expert
    want = all_reduce(rest, 8) + all_reduce(8 * 2 * expert, 2)
    assert half == pytest.approx((1 - costs.dp_overlap) * want, rel=1e-9)


def test_shipped_mixtral_recipe_is_the_planners_first_choice_with_ep8(mixtral):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.training.config import register_schema
    from tests.helpers import RECIPES

    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="mixtral-8x7b-64gpu", overrides=["trainer.out_dir=unused"]))
    best = plan(
        mixtral,
        H100,
        gpus=64,
        global_batch=256,
        seq_len=4096,
        space=SearchSpace(ep=8, cp=1, max_vpp=1, schedules=("1f1b",)),
    )[0]
    p, s = cfg.parallel, best.strategy
    assert (p.tp, p.pp, p.dp, p.ep, p.sp, p.microbatches) == (
        s.layout.tp,
        s.layout.pp,
        s.layout.dp,
        s.layout.ep,
        s.sp,
        s.micro_batches,
    )
    assert s.recompute == cfg.parallel.recompute and best.prediction.fits


def test_the_overrides_of_an_ep_plan_name_ep_and_an_aux_loss_the_schedule_can_run(mixtral, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.cli.plan import trainer_overrides
    from modelpar.training.config import register_schema, validate
    from tests.helpers import RECIPES

    strategy = Strategy(ParallelLayout(tp=2, pp=4, dp=8, ep=8), 1, 32, "none", 1, True)
    overrides = trainer_overrides(strategy, 4096, mixtral)
    assert "parallel.ep=8" in overrides and "optim.zero=1" in overrides
    assert "model.moe.aux_loss_scope=micro_batch" in overrides  # 1F1B at 32 micro-batches
    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = OmegaConf.to_object(
            compose(config_name="train", overrides=["model=mixtral-8x7b", *overrides, f"trainer.out_dir={tmp_path}"])
        )
    layout = validate(cfg)
    assert (layout.tp, layout.pp, layout.dp, layout.ep) == (2, 4, 8, 8)
    one = Strategy(ParallelLayout(tp=2, pp=4, dp=8, ep=8), 32, 1, "none", 0, True)
    assert "model.moe.aux_loss_scope=micro_batch" not in trainer_overrides(one, 4096, mixtral)


@pytest.fixture(scope="module")
def qwen3_moe():
    return load_model("qwen3-30b-a3b")


def test_qwen3_30b_a3b_has_its_published_parameter_counts(qwen3_moe):
    """30.5B parameters, 3.3B active (embedding included): head_dim 128 is not hidden/heads = 64, so attention
    counts 2048 x 128 per head; 8 of 128 experts per token."""
    shape = qwen3_moe.shape
    assert (shape.head_size, shape.attention_width) == (128, 4096)
    total = stage_params(qwen3_moe, ParallelLayout(), 0)  # one rank holding everything
    assert 30.4e9 < total < 30.6e9
    assert 3.25e9 < shape.matmul_params() + shape.vocab_size * shape.hidden < 3.4e9
    assert stage_params(qwen3_moe, ParallelLayout(pp=2, dp=4, ep=4), 0) < total / 2 / 3  # experts / ep


def test_shipped_qwen3_recipe_is_the_planners_first_choice_with_ep8(qwen3_moe):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.training.config import register_schema, validate
    from tests.helpers import RECIPES

    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="qwen3-30b-a3b-64gpu", overrides=["trainer.out_dir=unused"]))
    validate(cfg)
    assert cfg.model.identity() == qwen3_moe.shape.identity()
    space = SearchSpace(ep=8, cp=1, max_vpp=1, schedules=("1f1b",))  # the recipe runs 1F1B
    best = plan(qwen3_moe, H100, gpus=64, global_batch=256, seq_len=4096, space=space)[0]
    p, s = cfg.parallel, best.strategy
    got = (p.tp, p.pp, p.dp, p.ep, p.sp, p.microbatches, p.recompute)
    assert got == (s.layout.tp, s.layout.pp, s.layout.dp, s.layout.ep, s.sp, s.micro_batches, s.recompute)
    assert best.prediction.fits
