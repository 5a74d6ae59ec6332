"""Expert parallelism computes what the single-device mixture of experts computes: losses, gradient norms and
parameters (experts, routers, the balancing bias) step by step, over 3 steps."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.model.config import MoEConfig
from modelpar.parallel.layout import LayoutError
from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError, validate
from tests.helpers import TINY, assemble, make_config
from tests.training.recorded_runs import fit_and_read_metrics, train_and_collect

ROUTERS = {
    # Mixtral: softmax top-2, with the load-balancing and z losses (their gradients cross the all-to-alls)
    "softmax": MoEConfig(experts=4, top_k=2, ffn_hidden=24, aux_loss_coef=0.05, z_loss_coef=0.01),
    # DeepSeek-V3: sigmoid top-3 with the balancing bias moved after every step; MoE in layers 2, 3 only
    "sigmoid": MoEConfig(experts=4, top_k=3, ffn_hidden=24, router="sigmoid", bias_update_rate=0.05, layers=[2, 3]),
    # DeepSeek-V3 routing: 2 groups of 2 experts, the best group kept, weights scaled; a dense first layer; a
    # shared expert; the sequence-wise balance loss, which no micro-batch split or layout changes
    "deepseek": MoEConfig(
        experts=4,
        top_k=2,
        ffn_hidden=24,
        router="sigmoid",
        bias_update_rate=0.05,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        first_k_dense_replace=1,
        shared_experts=1,
        aux_loss_coef=0.05,
        aux_loss_scope="sequence",
    ),
}


def moe_config(tmp_path, router: str, zero_: int = 0, scope_: str | None = None, **parallel):
    cfg = make_config(tmp_path, **parallel)
    moe = ROUTERS[router]
    model = replace(TINY, tie_embeddings=False, moe=replace(moe, aux_loss_scope=scope_ or moe.aux_loss_scope))
    if router == "deepseek":  # with two multi-token prediction modules (MoE blocks, as the last layer) on top
        model = replace(model, mtp_depth=2, mtp_loss_weight=0.5)
    # replicas are compared every step: experts must agree with the ranks holding the same experts only
    trainer = replace(cfg.trainer, check_every=1, drift_action="halt")
    return replace(cfg, model=model, optim=replace(cfg.optim, zero=zero_), trainer=trainer)


_references: dict = {}


def reference(router: str, microbatches: int, token_path: str, tmp_path_factory, scope: str = "global_batch"):
    """The single-device run. The aux loss over the whole batch, or per sequence, does not depend on the
    micro-batches: its reference is one micro-batch, the batch itself."""
    if (router == "softmax" and scope == "global_batch") or scope == "sequence":
        microbatches = 1
    key = (router, microbatches, scope)
    if key not in _references:
        cfg = moe_config(tmp_path_factory.mktemp("ref"), router, microbatches=microbatches, scope_=scope)
        ((losses, grads, pieces, _),) = run_on_ranks(1, train_and_collect, cfg, token_path)
        _references[key] = losses, assemble([(None, grads)]), assemble([(None, pieces)])
    return _references[key]


# (router, layout). The softmax router's aux loss is over the whole global batch: the layouts compare with the
# single device at one micro-batch, several micro-batches need a schedule with every forward first (gpipe).
# Over each global micro-batch instead (scope_=micro_batch), a layout compares at the same micro-batches and
# dp (dp moves which sequences share a micro-batch). The bias update uses the step's whole batch.
LAYOUTS = [
    ("softmax", dict(microbatches=4, schedule="gpipe")),  # one device: 4 micro-batches give the batch's loss
    ("softmax", dict(dp=2, ep=2, microbatches=2, schedule="gpipe")),
    ("softmax", dict(pp=2, dp=2, ep=2, microbatches=2, schedule="gpipe")),
    ("softmax", dict(tp=2, dp=2, ep=2, microbatches=2, schedule="gpipe", zero_=1)),
    ("softmax", dict(tp=2, microbatches=2, scope_="micro_batch")),  # 1F1B, over each global micro-batch
    ("softmax", dict(pp=2, microbatches=2, schedule="zb-h1", scope_="micro_batch")),
    ("softmax", dict(dp=2, ep=2, microbatches=1)),
    ("softmax", dict(dp=4, ep=2, microbatches=1)),  # ep inside dp: experts replicated over pairs of ranks
    ("softmax", dict(tp=2, dp=2, ep=2, microbatches=1)),  # the tokens split over tp inside the MoE layer
    ("softmax", dict(tp=2, sp=True, dp=2, ep=2, microbatches=1)),
    ("softmax", dict(pp=2, dp=2, ep=2, microbatches=1)),
    ("softmax", dict(cp=2, ep=2, microbatches=1)),  # ep carved from cp: each rank holds 2 of 4 sequence chunks
    ("softmax", dict(cp=2, dp=2, ep=2, microbatches=1)),
    ("softmax", dict(cp=2, ep=2, microbatches=1, cp_comm="alltoall")),  # attention's heads exchanged over cp
    ("softmax", dict(dp=2, ep=2, microbatches=1, recompute="full")),
    ("softmax", dict(dp=2, ep=2, microbatches=1, recompute="selective", recompute_modules=["mlp", "elementwise"])),
    ("softmax", dict(dp=2, microbatches=1, zero_=1)),  # ZeRO with the experts replicated over dp (ep=1)
    ("softmax", dict(dp=2, ep=2, microbatches=1, zero_=1)),  # ZeRO-1: each expert's state on its own rank
    ("softmax", dict(dp=4, ep=2, microbatches=1, zero_=1)),  # ... sharded over the pair holding the same experts
    ("softmax", dict(tp=2, dp=2, ep=2, microbatches=1, zero_=1)),
    ("softmax", dict(dp=2, microbatches=1, zero_=3)),
    ("softmax", dict(tp=2, dp=2, microbatches=1, zero_=3)),  # experts stacked in one parameter, tp sums per shard
    ("softmax", dict(dp=2, ep=2, microbatches=1, zero_=3)),  # ZeRO-3 x ep: each rank alone holds its experts
    ("softmax", dict(dp=4, ep=2, microbatches=1, zero_=2)),  # experts sharded over the pair holding them (FSDP2)
    ("softmax", dict(dp=4, ep=2, microbatches=1, zero_=3)),
    ("softmax", dict(tp=2, dp=2, ep=2, microbatches=1, zero_=3)),
    ("softmax", dict(cp=2, dp=2, ep=2, microbatches=1, zero_=3)),  # experts sharded over a dp x cp pair
    ("softmax", dict(cp=2, ep=2, microbatches=1, zero_=2)),
    ("softmax", dict(pp=2, dp=2, ep=2, microbatches=2, schedule="gpipe", zero_=3)),
    ("sigmoid", dict(dp=2, microbatches=2, zero_=1)),
    ("sigmoid", dict(dp=2, microbatches=2, zero_=3)),  # the bias stays whole on every rank (FSDP2 ignores it)
    ("sigmoid", dict(tp=2, dp=2, microbatches=2, zero_=2)),
    ("sigmoid", dict(dp=2, ep=2, microbatches=2, zero_=3)),
    ("sigmoid", dict(pp=2, dp=2, ep=2, microbatches=2, schedule="zb-h1", zero_=3)),  # split backward, whole experts
    ("sigmoid", dict(dp=4, ep=2, microbatches=2, zero_=1)),
    ("sigmoid", dict(dp=2, ep=2, microbatches=2)),
    ("sigmoid", dict(tp=2, dp=2, ep=2, microbatches=2)),
    ("sigmoid", dict(pp=2, dp=2, ep=2, microbatches=2)),  # stage 0 holds no MoE layer
    ("sigmoid", dict(pp=2, microbatches=2, schedule="zb-h1")),
    # two chunks per rank in a V: rank 0 holds the first and the last chunk
    ("softmax", dict(pp=2, vpp=2, microbatches=2, schedule="zbv", scope_="micro_batch")),
    ("sigmoid", dict(pp=2, vpp=2, dp=2, ep=2, microbatches=2, schedule="dualpipev")),
    # m = 2 pp: two of DualPipeV's overlapped pairs, one micro-batch computing while the other's all-to-all flies
    ("sigmoid", dict(pp=2, vpp=2, dp=2, ep=2, microbatches=4, schedule="dualpipev")),
    ("sigmoid", dict(pp=2, vpp=2, dp=2, ep=2, microbatches=4, schedule="dualpipev", zero_=2)),  # pairs under FSDP2
    ("sigmoid", dict(pp=2, vpp=2, dp=2, ep=2, microbatches=4, schedule="dualpipev", zero_=3)),
    ("sigmoid", dict(pp=2, vpp=2, cp=2, ep=2, microbatches=8, schedule="dualpipev", zero_=3)),
    ("sigmoid", dict(pp=2, vpp=2, dp=2, ep=2, microbatches=2, schedule="zbv", zero_=3)),
    # group-limited routing and the sequence-wise loss, against one device at one micro-batch
    ("deepseek", dict(dp=2, ep=2, microbatches=2)),
    ("deepseek", dict(tp=2, dp=2, ep=2, microbatches=2)),  # a sequence's tokens split over tp in the MoE layer
    ("deepseek", dict(tp=2, sp=True, cp=2, ep=2, microbatches=1)),
    ("deepseek", dict(pp=2, dp=2, ep=2, microbatches=2)),
    ("deepseek", dict(cp=2, dp=2, ep=2, microbatches=2)),  # a sequence's chunks on two cp ranks
]


@pytest.mark.parametrize(
    "router, layout", LAYOUTS, ids=[r + "-" + "-".join(f"{k}{v}" for k, v in d.items()) for r, d in LAYOUTS]
)
def test_expert_parallel_layout_matches_single_device(router, layout, token_path, tmp_path, tmp_path_factory):
    cfg = moe_config(tmp_path, router, **layout)
    ref_losses, ref_grads, ref_params = reference(
        router, cfg.parallel.microbatches, token_path, tmp_path_factory, cfg.model.moe.aux_loss_scope
    )
    world = cfg.parallel.layout().world_size
    results = run_on_ranks(world, train_and_collect, cfg, token_path)
    for losses, *_ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=str(layout))
    if layout.get("schedule") == "dualpipev" and layout["microbatches"] >= 2 * layout["pp"]:
        # the pairs ran at once, taking turns (at m = 2 pp only the last pipeline rank has a pair)
        assert any(handed > 0 for *_, handed in results), [r[-1] for r in results]
    grads = assemble([(None, g) for _, g, _, _ in results])
    compared = {} if cfg.optim.zero else ref_grads  # ZeRO keeps its reduced gradients in its own shards
    assert grads.keys() == compared.keys()
    for name, ref in compared.items():  # the same weights, the same batch: the same function's gradient
        scale = float(ref.abs().max())
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")
    params = assemble([(None, p) for _, _, p, _ in results])
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        # AdamW turns fp32 round-off of differently ordered sums into ~1e-6 of weight after 3 steps (dense
        # tp layouts show the same); the gradients above are the tight check
        # tp2 x sp x cp2 with the deepseek router's scaled weights and two MTP depths: one weight of 2048 (of
        # mtp.0.eh_proj, a near-zero gradient) moves 5e-6 apart after 3 steps
        atol = 1e-5 if router == "deepseek" else 3e-6
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    if router == "sigmoid":  # the bias really moved, and every rank moved it alike (assemble keeps one copy)
        assert params["layers.2.mlp.gate.e_score_correction_bias"].abs().sum() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(parallel=dict(dp=4, ep=3)),
            r"ep=3 must divide model.moe.experts=4 and dp x cp = 4; try ep in \[1, 2, 4\]",
        ),
        (
            dict(parallel=dict(dp=3, ep=3)),
            r"parallel.ep=3 must divide model.moe.experts=4 and dp x cp = 3; try ep in \[1\]",
        ),
        (dict(parallel=dict(dp=2, etp=2)), "parallel.etp=2: expert tensor parallelism is not supported"),
        (
            dict(parallel=dict(dp=4, ep=2, microbatches=1), zero=3, zero_group=2),
            "optim.zero_group=2 with parallel.ep=2",
        ),
        (dict(moe=dict(top_k=5)), "model.moe.top_k=5 must be in 1..experts=4"),
        (dict(parallel=dict(dp=2, ep=2, microbatches=2)), "aux_loss_scope=global_batch needs every micro-batch"),
        (dict(moe=dict(aux_loss_scope="batch")), "model.moe.aux_loss_scope='batch' is not one of"),
    ],
)
def test_bad_expert_recipes_are_refused_in_one_line_before_ranks_start(change, message, tmp_path):
    cfg = moe_config(tmp_path, "softmax", **change.get("parallel", {}))
    if "zero" in change:
        cfg = replace(cfg, optim=replace(cfg.optim, zero=change["zero"], zero_group=change.get("zero_group", 0)))
    if "moe" in change:
        cfg = replace(cfg, model=replace(cfg.model, moe=replace(cfg.model.moe, **change["moe"])))
    with pytest.raises((RecipeError, LayoutError), match=message) as info:
        validate(cfg)
    assert "\n" not in str(info.value)


RESUMED = [dict(ep=2), dict(zero_=3), dict(ep=2, zero_=3), dict(dp=4, ep=2, zero_=3)]


@pytest.mark.parametrize("layout", RESUMED, ids=["ep2", "zero3", "ep2-zero3", "dp4-ep2-zero3"])
def test_expert_parallel_resume_continues_bit_for_bit(token_path, tmp_path, layout):
    from tests.helpers import train_and_collect as train_and_save

    cfg = moe_config(tmp_path / "a", "sigmoid", microbatches=2, **{"dp": 2, **layout})
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=4))
    world = cfg.parallel.layout().world_size
    straight = run_on_ranks(world, train_and_save, cfg, token_path, None, (2,))
    ckpt = str(tmp_path / "a" / "checkpoints" / "step-00000002")
    resumed_cfg = replace(cfg, trainer=replace(cfg.trainer, out_dir=str(tmp_path / "b")))
    resumed = run_on_ranks(world, train_and_save, resumed_cfg, token_path, ckpt)
    for (losses_a, pieces_a), (losses_b, pieces_b) in zip(straight, resumed, strict=True):
        assert losses_a[2:] == losses_b, "losses after resume differ"
        for key, tensor in pieces_a.items():  # experts, routers and the balancing bias alike
            assert torch.equal(tensor, pieces_b[key]), f"{key[0]} differs after resume"


@pytest.mark.parametrize("layout", [dict(), dict(dp=4, ep=4), dict(tp=2, dp=2, ep=2)], ids=str)
def test_ep2_checkpoint_loads_into_other_layouts_with_identical_logits(token_path, tmp_path, layout):
    from tests.helpers import logits_after_loading
    from tests.helpers import train_and_collect as train_and_save

    cfg = moe_config(tmp_path / "src", "softmax", dp=2, ep=2, microbatches=1)
    run_on_ranks(2, train_and_save, cfg, token_path, None, (3,))
    ckpt = str(tmp_path / "src" / "checkpoints" / "step-00000003")
    ((want, _),) = run_on_ranks(1, logits_after_loading, moe_config(tmp_path / "ref", "softmax"), token_path, ckpt)
    new_cfg = moe_config(tmp_path / "dst", "softmax", **layout)
    world = new_cfg.parallel.tp * new_cfg.parallel.dp
    for logits, _ in run_on_ranks(world, logits_after_loading, new_cfg, token_path, ckpt):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)


def test_routing_metrics_reach_metrics_jsonl_and_do_not_depend_on_the_layout(token_path, tmp_path):
    single = moe_config(tmp_path / "one", "softmax", microbatches=1)
    (want,) = run_on_ranks(1, fit_and_read_metrics, single, token_path)
    got = run_on_ranks(
        4, fit_and_read_metrics, moe_config(tmp_path / "ep", "softmax", pp=2, dp=2, ep=2, microbatches=1), token_path
    )[0]
    assert len(got) == len(want) == 3
    for ours, theirs in zip(got, want, strict=True):
        layer = ours["moe"]["layers"]["3"]
        assert sum(layer["tokens_per_expert"]) == 8 * 16 * 2  # every token of the global batch, top-2
        assert layer["tokens_per_expert"] == theirs["moe"]["layers"]["3"]["tokens_per_expert"]
        assert layer["imbalance"] >= 1.0 and layer["dropped_fraction"] == 0.0
        assert ours["moe"]["aux_loss"] == pytest.approx(theirs["moe"]["aux_loss"], rel=1e-5)
        assert ours["moe"]["aux_loss"] > 0 and sorted(ours["moe"]["layers"]) == ["0", "1", "2", "3"]


def test_capacity_factor_drops_tokens_and_reports_the_fraction(token_path, tmp_path):
    cfg = moe_config(tmp_path, "softmax", microbatches=1)
    cfg = replace(cfg, model=replace(cfg.model, moe=replace(cfg.model.moe, capacity_factor=0.5)))
    (metrics,) = run_on_ranks(1, fit_and_read_metrics, cfg, token_path)
    # at most half of the routed rows fit (capacity 0.5 x the even share), so at least half are dropped
    assert all(m["moe"]["dropped_fraction"] >= 0.5 for m in metrics)


def test_flops_count_active_experts_and_the_partitioner_balances_moe_stages(tmp_path):
    from modelpar.model.flops import half_block_training_flops, training_flops_per_token
    from modelpar.training.build import build_partition

    heavy = replace(ROUTERS["sigmoid"], top_k=4, ffn_hidden=96)  # MoE in layers 2, 3, each 4 x 96 wide
    cfg = moe_config(tmp_path, "sigmoid", pp=2)
    cfg = replace(cfg, model=replace(cfg.model, moe=heavy), parallel=replace(cfg.parallel, partition="blocks"))
    shape = cfg.model
    assert half_block_training_flops(shape, 16, 3)[1] == 6.0 * (32 * 4 + 4 * 3 * 32 * 96)  # router + 4 experts
    assert half_block_training_flops(shape, 16, 0)[1] == 6.0 * 3 * 32 * 48  # a dense block
    dense = replace(shape, moe=MoEConfig())
    extra = 2 * 6.0 * (32 * 4 + 4 * 3 * 32 * 96 - 3 * 32 * 48)
    assert training_flops_per_token(shape, 16) == pytest.approx(training_flops_per_token(dense, 16) + extra)
    # the two heavy MoE blocks are worth more than the dense ones: the later stage gets fewer blocks
    partition = build_partition(cfg)
    assert list(partition.layers(0)) == [0, 1, 2] and list(partition.layers(1)) == [3]


def _all_to_all_bytes_of_one_step():
    from modelpar.model.transformer import build_model
    from modelpar.parallel.collectives import record_comm
    from modelpar.testing import current_groups

    config = replace(TINY, tie_embeddings=False, moe=ROUTERS["softmax"])
    model = build_model(config, current_groups(), seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with record_comm() as log:
        model.loss(model(ids), ids).backward()
    return log.total_bytes("all_to_all"), log.count("all_to_all")


def test_each_moe_layer_moves_its_routed_rows_four_times_through_all_to_all():
    from modelpar.parallel.layout import ParallelLayout

    ranks = run_on_ranks(2, _all_to_all_bytes_of_one_step, layout=ParallelLayout(dp=2, ep=2))
    layers, rows, h = 4, 2 * (2 * 16 * 2), 32  # every layer MoE; both ranks' 32 tokens x top-2 rows of h floats
    split_sizes = 2 * 2 * 8  # [ep, experts/ep] int64 counts, once per layer forward, on each rank
    # what a rank sends back is what it received, uneven: the two ranks together send every row each time
    assert [count for _, count in ranks] == [layers * 5] * 2  # counts; dispatch, combine; combine, dispatch
    assert sum(nbytes for nbytes, _ in ranks) == layers * (2 * split_sizes + 4 * rows * h * 4)


def test_reshard_cli_writes_an_ep_layout_and_refuses_an_ep_that_cannot_split_the_experts(token_path, tmp_path, capsys):
    from modelpar.checkpoint.store import Piece, load_pieces, read_index
    from modelpar.cli.ckpt import main as ckpt_main
    from tests.helpers import train_and_collect as train_and_save

    cfg = moe_config(tmp_path / "src", "softmax", dp=2, ep=2, microbatches=1)
    run_on_ranks(2, train_and_save, cfg, token_path, None, (2,))
    src = tmp_path / "src" / "checkpoints" / "step-00000002"
    assert ckpt_main(["reshard", str(src), str(tmp_path / "dst"), "--dp", "4", "--ep", "4"]) == 0
    dst = next((tmp_path / "dst").glob("step-*"))
    a, b = read_index(src), read_index(dst)
    assert (b["layout"]["ep"], b["layout"]["dp"]) == (4, 4)
    wanted = [Piece.whole(name, tuple(entry["global_shape"])) for name, entry in a["tensors"].items()]
    assert any(".experts.3.w2.weight" in p.name for p in wanted)
    before, after = load_pieces(src, a, wanted), load_pieces(dst, b, wanted)
    assert all(torch.equal(before[p], after[p]) for p in wanted)
    capsys.readouterr()
    assert ckpt_main(["reshard", str(src), str(tmp_path / "bad"), "--dp", "3", "--ep", "3"]) != 0
    err = capsys.readouterr().err.strip()
    assert "parallel.ep=3 does not divide model.moe.experts=4" in err and "\n" not in err
    assert not (tmp_path / "bad").exists()


def test_bf16_autocast_at_dp2_ep2_tracks_the_single_device_bf16_run(token_path, tmp_path):
    """Under bf16 autocast the experts' grouped GEMMs and the all-to-alls carry bf16 rows while the router's
    softmax and the aux loss stay fp32: dp2 x ep2's losses and norms follow the single device's to bf16's
    precision."""
    runs = {}
    for name, layout in (("single", {}), ("ep2", dict(dp=2, ep=2))):
        cfg = moe_config(tmp_path / name, "softmax", microbatches=1, **layout)
        cfg = replace(cfg, trainer=replace(cfg.trainer, dtype="bf16"))
        runs[name] = run_on_ranks(cfg.parallel.dp, train_and_collect, cfg, token_path)[0][0]
    np.testing.assert_allclose(runs["ep2"], runs["single"], rtol=3e-3)
    fp32 = run_on_ranks(1, train_and_collect, moe_config(tmp_path / "fp32", "softmax", microbatches=1), token_path)
    assert runs["single"] != fp32[0][0]  # bf16 really ran
