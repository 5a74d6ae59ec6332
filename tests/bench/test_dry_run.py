"""The dry run: one rank of a 64-rank job built and stepped on the meta device under the fake process group."""

import dataclasses
import json
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from modelpar.bench.dry_run import rank_roles, step_rank
from modelpar.bench.meta_world import CpuAttention, MetaStep, fake_world
from modelpar.parallel import collectives
from modelpar.parallel.layout import ParallelLayout
from tests import warm_cli
from tests.helpers import make_config


@pytest.fixture(scope="module")
def first_stage(tmp_path_factory):
    """Rank 0 of tp2 x pp2 x dp16 (64 ranks), the tiny model untied with 64 tokens, 2 layers a stage."""
    cfg = make_config(tmp_path_factory.mktemp("dry"), tp=2, pp=2, dp=16, sp=True, partition="uniform")
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False)
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, global_batch=32))
    return step_rank(cfg, 0, "first stage")


def test_model_states_equal_a_hand_count(first_stage):
    h, f, d = 32, 48 // 2, 8  # tp2: 2 of 4 q heads, 1 of 2 kv heads, half of the MLP
    layer = h + (2 + 2) * d * h + h * 2 * d + h + 2 * f * h + h * f  # norm, qkv, o_proj, norm, gate|up, down
    params = 2 * layer + 64 // 2 * h  # two layers and half the embedding
    tensors = 2 * 6 + 1
    assert first_stage.states == {
        "weights": 4 * params,
        "gradients": 4 * params,
        "optimizer": 8 * params,  # AdamW's two moments
        "buffers": 4 * tensors,  # zero-0's buckets hold the gradients themselves, and a flag a tensor
        "gathered": 0,
    }
    assert first_stage.states_exact  # the planner's too


def test_gradients_are_all_reduced_over_dp_once(first_stage):
    assert first_stage.traffic["dp all_reduce"] == first_stage.states["gradients"] + first_stage.states["buffers"]


def test_activations_equal_the_planner(first_stage):
    assert first_stage.activations == first_stage.planned_activations > 0


def test_rank_roles_name_each_stage_and_the_last_tp_cp_ep_rank():
    roles = dict(rank_roles(ParallelLayout(tp=8, pp=16, dp=8, cp=16)))
    assert roles[0] == "first stage" and roles[7] == "first stage, tp 7" and roles[15 * 8] == "first stage, cp 15"
    assert sum("middle" in r for r in roles.values()) == 3 and sum("last" in r for r in roles.values()) == 3
    layout = ParallelLayout(tp=8, pp=16, dp=8, cp=16)
    fullest = dict(rank_roles(layout, fullest=2))  # the stage the planner finds fullest, also checked
    assert fullest[layout.rank(pp=2)] == "fullest stage" and sum("fullest" in r for r in fullest.values()) == 3


def test_meta_attention_keeps_no_scores():
    q, k, v = (torch.empty(1, 4, 256, 8, device="meta", requires_grad=True) for _ in range(3))
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t), CpuAttention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert shapes and all(s[-2:] != (256, 256) for s in shapes)


def test_read_backs_see_a_symmetric_world_and_balanced_routing():
    with fake_world(5, 8):
        mode = MetaStep()
        with mode:
            counts = torch.bincount(torch.empty(30, dtype=torch.int64, device="meta"), minlength=4)
            assert counts.tolist() == [8, 8, 7, 7]
            gathered = collectives.all_gather(counts[:2].contiguous(), None)
            assert gathered.tolist() == [8, 8] * 8
            assert mode.blind_reads == 0
        assert mode.bytes[("group of 8", "all_gather")] == 16 * 8


def test_the_train_command_ends_with_the_summary_line(tmp_path):
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", "parallel=tp2-pp2", "parallel.dp=16", "data.global_batch=64",
         "trainer.dry_run=true", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["world"] == 64 and summary["ranks_checked"] == 4
    assert summary["worst_memory_rel_err"] == 0.0 and summary["worst_comm_rel_err"] < 0.05


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp2_stages_equal_the_planner(tmp_path, zero):
    """ZeRO-2/3 (FSDP2) on the meta device: sharded states, the gathered weights' peak and FSDP2's own gathers
    and reduce-scatters equal the planner's, and ``torch.meta`` is gone again after the step."""
    cfg = make_config(tmp_path, pp=2, dp=4, partition="uniform")
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False)
    optim = dataclasses.replace(cfg.optim, zero=zero)
    cfg = dataclasses.replace(cfg, model=model, optim=optim, data=dataclasses.replace(cfg.data, global_batch=16))
    report = step_rank(cfg, 0, "first stage")
    assert report.states["gathered"] > report.states["weights"] > 0
    assert report.states_exact, (report.states, report.planned_states)
    assert report.activations == report.planned_activations > 0
    for kind in ("dp all_gather", "dp reduce_scatter"):
        assert report.traffic[kind] == report.planned_traffic[kind] > 0, kind
    assert "dp all_reduce" not in report.judged
    assert not hasattr(torch, "meta")


def test_zero1_with_expert_parallelism_shards_the_experts_over_their_own_group(tmp_path):
    """ZeRO-1 at dp8 x ep2 with MTP: the experts' state (their biases too) is sharded over the 4 ranks holding
    the same experts (expert_dp), the rest over dp; the untied embedding is synced with the MTP stage. The
    planner agrees."""
    from modelpar.model.config import MoEConfig

    cfg = make_config(tmp_path, pp=2, dp=8, ep=2, partition="uniform")
    moe = MoEConfig(experts=4, top_k=2, ffn_hidden=16, shared_experts=1, first_k_dense_replace=1, bias=True)
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False, mtp_depth=1, moe=moe)
    optim = dataclasses.replace(cfg.optim, zero=1)
    cfg = dataclasses.replace(cfg, model=model, optim=optim, data=dataclasses.replace(cfg.data, global_batch=16))
    report = step_rank(cfg, 0, "first stage")
    assert report.states_exact, (report.states, report.planned_states)
    for kind in ("expert_dp reduce_scatter", "expert_dp all_gather", "embedding all_reduce", "dp all_gather"):
        assert report.traffic[kind] == report.planned_traffic[kind] > 0, kind


def test_meta_attention_with_values_of_their_own_head_dim_keeps_their_width():
    """Latent attention's v (dv) beside q and k (dk): the CPU flash kernel refuses it, so the math path runs."""
    q, k = (torch.empty(1, 4, 16, 12, device="meta") for _ in range(2))
    with CpuAttention():
        out = F.scaled_dot_product_attention(q, k, torch.empty(1, 4, 16, 6, device="meta"), is_causal=True)
    assert out.shape == (1, 4, 16, 6)


def test_the_mtp_stage_routes_its_modules_tokens_too(tmp_path):
    """The last stage's MTP block is a MoE block: its all-to-all is planned with the stage's own layers."""
    from modelpar.model.config import MoEConfig

    cfg = make_config(tmp_path, pp=2, dp=2, ep=2, partition="uniform")
    moe = MoEConfig(experts=4, top_k=2, ffn_hidden=16)
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False, mtp_depth=1, moe=moe)
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, global_batch=4))
    report = step_rank(cfg, 1, "last stage")
    # within the split counts each layer exchanges first (a few hundred bytes, not planned)
    assert report.traffic["ep all_to_all"] == pytest.approx(report.planned_traffic["ep all_to_all"], rel=0.01)


def test_the_planner_counts_the_mtp_modules_saved_tensors(tmp_path):
    """Two MTP modules on the last stage of tp2 (+sp) x pp2 x dp2: their embeddings, norms, projections, blocks
    and heads are planned byte for byte."""
    cfg = make_config(tmp_path, pp=2, dp=2, tp=2, sp=True, partition="uniform")
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False, mtp_depth=2)
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, global_batch=4))
    report = step_rank(cfg, cfg.parallel.layout().rank(pp=1), "last stage")
    plain = dataclasses.replace(cfg, model=dataclasses.replace(model, mtp_depth=0))
    without = step_rank(plain, cfg.parallel.layout().rank(pp=1), "last stage")
    assert report.activations > without.activations
    assert report.activations == report.planned_activations


@pytest.mark.parametrize("cp", [2, 4])
def test_selective_recompute_keeps_the_cp_attention_whole(tmp_path, cp):
    """Under ``recompute_modules=[elementwise]`` the cp attention is one kept result (its output and lse), as the
    planner plans, not every ring block's partial attention (1.16x the plan at cp2, 1.23x at cp4 before)."""
    cfg = make_config(tmp_path, cp=cp, dp=4 // cp, partition="uniform", recompute="selective",
                      recompute_modules=["elementwise"])  # fmt: skip
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False)
    data = dataclasses.replace(cfg.data, global_batch=16, document_mask=True)
    report = step_rank(dataclasses.replace(cfg, model=model, data=data), 0, "first stage")
    assert report.activations == report.planned_activations > 0
    # and the rerun in backward sends no K/V block again: the planner's cp bytes, without a second forward
    assert report.traffic["cp send"] == pytest.approx(report.planned_traffic["cp send"], rel=1e-9)


@pytest.mark.parametrize("modules", [["elementwise"], ["attention"]])
def test_selective_recompute_runs_on_the_meta_device_and_equals_the_planner(tmp_path, modules):
    """The checkpoint's rerun happens on the meta device's autograd thread: the meta attention must be the
    flash op there too, or selective recompute finds ops in the rerun that the forward did not run."""
    cfg = make_config(tmp_path, dp=2, partition="uniform", recompute="selective", recompute_modules=modules)
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False)
    data = dataclasses.replace(cfg.data, global_batch=16)
    report = step_rank(dataclasses.replace(cfg, model=model, data=data), 0, "first stage")
    assert report.activations == report.planned_activations > 0


@pytest.mark.parametrize(
    ("sp", "recompute", "modules"),
    [(True, "selective", ["attention"]), (True, "selective", ["elementwise"]), (True, "full", []), (False, "full", [])],
)
def test_reruns_repeat_the_tp_exchanges_their_backward_needs_as_planned(tmp_path, sp, recompute, modules):
    """A rerun stops at the last tensor its backward needs: under SP each rerun half's all-gather repeats, and
    the attention half's closing exchange only under full recompute (the MLP's norm reads its output)."""
    cfg = make_config(tmp_path, tp=2, dp=2, sp=sp, partition="uniform", recompute=recompute, recompute_modules=modules)
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False)
    data = dataclasses.replace(cfg.data, global_batch=8)
    report = step_rank(dataclasses.replace(cfg, model=model, data=data), 0, "first stage")
    kinds = ("tp all_gather", "tp reduce_scatter") if sp else ("tp all_reduce",)
    for kind in kinds:
        # (within 1%: the loss's own few-byte all-reduces are not the planner's)
        assert report.traffic[kind] == pytest.approx(report.planned_traffic[kind], rel=1e-2), kind
    if sp:  # the reruns add all-gathers, not as many reduce-scatters
        assert report.traffic["tp all_gather"] > report.traffic["tp reduce_scatter"]


def test_sequence_parallel_linears_keep_their_input_shard_and_gather_it_again_in_backward(tmp_path):
    """Under SP each column-parallel linear (qkv, gate|up, the head) keeps its input's [T/t, h] shard, not the
    gathered [T, h], and all-gathers it again in backward (``parallel.sp_keep_shard``, the default); the
    planner prices both ways, and the saved bytes drop by exactly the gathered inputs less their shards."""
    reports = {}
    for keep in (True, False):
        cfg = make_config(tmp_path / str(keep), tp=2, dp=2, sp=True, partition="uniform", sp_keep_shard=keep)
        model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False)
        data = dataclasses.replace(cfg.data, global_batch=8)
        reports[keep] = report = step_rank(dataclasses.replace(cfg, model=model, data=data), 0, "first stage")
        assert report.activations == report.planned_activations > 0
        for kind in ("tp all_gather", "tp reduce_scatter"):
            assert report.traffic[kind] == pytest.approx(report.planned_traffic[kind], rel=1e-2), kind
    layers, h, tokens = cfg.model.layers, cfg.model.hidden, 2 * 16  # a micro-batch of 2 sequences of 16
    inputs = 2 * layers + 1  # qkv and gate|up of every layer, and the head
    assert reports[False].activations - reports[True].activations == inputs * (tokens - tokens // 2) * h * 4
    act = tokens * h * 4  # one [b, s, h] fp32 activation, as an all-gather's output counts it
    extra = reports[True].traffic["tp all_gather"] - reports[False].traffic["tp all_gather"]
    assert extra == cfg.parallel.microbatches * inputs * act
    assert reports[True].traffic["tp reduce_scatter"] == reports[False].traffic["tp reduce_scatter"]


def test_interleaved_fsdp2_holds_one_chunks_gradients_at_a_time_at_m_equal_p(tmp_path):
    """Interleaved 1F1B at m = p finishes each chunk's backwards before the next chunk's first: the gathered
    peak holds one chunk's unsharded gradients, as the planner's ``gradient_live_sets`` says."""
    cfg = make_config(tmp_path, pp=2, dp=2, vpp=2, schedule="interleaved", microbatches=2, partition="uniform")
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False, layers=4)
    optim = dataclasses.replace(cfg.optim, zero=2)
    cfg = dataclasses.replace(cfg, model=model, optim=optim, data=dataclasses.replace(cfg.data, global_batch=4))
    report = step_rank(cfg, 0, "first stage")
    # within 10%: the meter samples at saved-tensor packs and unpacks and misses the embedding's gradient (a
    # tenth of this tiny stage), which the planner counts; at 405B the same gap is 0.04% (first stage)
    assert report.states["gathered"] == pytest.approx(report.planned_states["gathered"], rel=0.1)
    # all of the stage's weights (fp32 here) gathered at zero-2, the gradients of one chunk, not both
    whole = 2 * report.states["weights"]  # this rank's dp shard (fp32) times dp = the stage's weights
    assert whole < report.states["gathered"] < 2 * whole


@pytest.mark.parametrize("dp", [2, 4])
def test_zero0_routed_expert_gradients_sync_over_the_ranks_holding_the_same_experts(tmp_path, dp):
    """At dp4 x ep2 the routed experts' gradients (their biases' too) are all-reduced over expert_dp (2 ranks),
    the rest over dp; at dp2 x ep2 (ep = dp) each rank's experts are its own and nothing syncs them: planned as
    measured."""
    from modelpar.model.config import MoEConfig

    cfg = make_config(tmp_path, dp=dp, ep=2)
    model = dataclasses.replace(cfg.model, vocab_size=64, moe=MoEConfig(experts=4, top_k=2, ffn_hidden=16, bias=True))
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, global_batch=2 * dp))
    report = step_rank(cfg, 0, "first stage")
    for kind in ("dp all_reduce", "expert_dp all_reduce"):
        assert report.traffic.get(kind, 0) == pytest.approx(report.planned_traffic.get(kind, 0), rel=1e-3), kind
    assert (report.traffic.get("expert_dp all_reduce", 0) > 0) == (dp == 4)


def test_tp_replicated_router_and_expert_gradients_are_summed_over_tp_as_planned(tmp_path):
    """tp2 (+sp) x dp2 x ep2: under SP the tp all-reduces are that of the gradients tp leaves partial (the routed
    experts', the router's and the norms', one buffer) and the vocab-parallel loss's per-token statistics, which
    the planner leaves out (3 floats a token, 0.7% here, nothing at real widths)."""
    from modelpar.model.config import MoEConfig

    cfg = make_config(tmp_path, tp=2, dp=2, ep=2, sp=True)
    model = dataclasses.replace(cfg.model, vocab_size=64, moe=MoEConfig(experts=4, top_k=2, ffn_hidden=16, bias=True))
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, global_batch=4))
    report = step_rank(cfg, 0, "first stage")
    assert report.traffic["tp all_reduce"] == pytest.approx(report.planned_traffic["tp all_reduce"], rel=1e-2)


@pytest.mark.parametrize(
    "layout, zero",
    [(dict(tp=2, pp=2, dp=4), 0), (dict(tp=2, pp=2, dp=4), 1), (dict(dp=4), 3)],
    ids=["tp2pp2dp4", "tp2pp2dp4zero1", "dp4zero3"],
)
def test_muons_exchange_is_counted_as_planned(tmp_path, layout, zero):
    """optim.name=muon dry-runs: its two all-to-alls over the stage's tp x dp x cp ranks are counted, and the
    planner's bytes for them are within 2%: it takes the engine's owners (balanced by FLOPs, not elements),
    ZeRO-0's replicas each writing their stretch, and ZeRO-1's segments as they fall (rank 0's begins with the
    embedding, so holds fewer Muon elements than an even share)."""
    cfg = make_config(tmp_path, partition="uniform", **layout)
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False)
    optim = dataclasses.replace(cfg.optim, name="muon", zero=zero)
    cfg = dataclasses.replace(cfg, model=model, optim=optim, data=dataclasses.replace(cfg.data, global_batch=16))
    report = step_rank(cfg, 0, "first stage")
    kind = "world all_to_all" if cfg.parallel.pp == 1 else "stage all_to_all"
    assert report.traffic[kind] == pytest.approx(report.planned_traffic[kind], rel=0.02)
    assert report.traffic[kind] > 0


def test_the_fake_world_comes_and_goes_without_a_warning(capfd):
    # c10d printed "No backend of type 0 found ..." at every teardown of the fake group (once per rank checked),
    # and the reduce-scatter's old torch name a FutureWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fake_world(0, 8):
            collectives.reduce_scatter(torch.zeros(16), None)
            collectives.all_gather(torch.zeros(2), None)
    assert "No backend of type" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("family", "parallel"),
    [
        ("gemma3", dict(tp=2, pp=2, dp=16, sp=True)),  # the gemma3-27b-64gpu recipe's split, tiny
        ("olmo2", dict(tp=2, pp=2, dp=16, sp=True)),
        ("gpt-oss", dict(cp=2, cp_comm="ring", pp=2, dp=16, ep=4)),  # gpt-oss-120b-64gpu's: the ring, experts
        ("gpt-oss-tp", dict(tp=2, sp=True, pp=2, dp=16, ep=4)),  # o_proj's and the experts' biases partial over tp
    ],
)
def test_the_families_block_structures_equal_the_planner_on_a_64_rank_job(tmp_path, family, parallel):
    """Gemma 3's sandwich, (1 + weight) norms, GeGLU and per-head QK-norm; OLMo 2's post-norms and whole-projection
    QK-norm; GPT-OSS's sinks (their plain-matmul attention), biases and biased clamped-SwiGLU experts: the first
    stage of a 64-rank job holds the model states the planner plans, keeps the activations it plans byte for byte,
    and moves its planned traffic (within 1%: the split counts each MoE layer exchanges first and a few-byte
    routing statistic are not planned)."""
    from modelpar.model.config import MoEConfig
    from modelpar.model.structure import BlockStructure

    cfg = make_config(tmp_path, partition="uniform", **parallel)
    structures = {
        "gemma3": dict(qk_norm=True, sliding_window=4, window_layers=[0],  # a local layer, its mask kept
                       block=BlockStructure(norm="sandwich", norm_offset=1.0, activation="geglu",
                                            embedding_scale=True, query_scale=24.0)),
        "olmo2": dict(qk_norm=True, block=BlockStructure(norm="post", qk_norm_scope="projection")),
        "gpt-oss": dict(attention_bias=True, attention_out_bias=True, block=BlockStructure(attention_sinks=True),
                        moe=MoEConfig(experts=4, top_k=2, ffn_hidden=16, bias=True, activation="clamped_swiglu")),
    }  # fmt: skip
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False, **structures[family[:7]])
    data = dataclasses.replace(cfg.data, global_batch=32)
    report = step_rank(dataclasses.replace(cfg, model=model, data=data), 0, "first stage")
    assert report.states_exact, (report.states, report.planned_states)
    assert report.activations == report.planned_activations > 0  # GPT-OSS: its clamped SwiGLU's and biases' too
    for kind in report.judged:
        assert report.traffic[kind] == pytest.approx(report.planned_traffic[kind], rel=0.01), kind


def test_the_final_soft_cap_keeps_its_tanh_on_the_last_stage_as_planned(tmp_path):
    """Gemma 2's final-logit soft-cap, cap * tanh(logits / cap), on the head's vocabulary shard: tanh keeps its
    output, one more [T, V/t] tensor on the last stage, planned byte for byte."""
    from modelpar.model.structure import BlockStructure

    cfg = make_config(tmp_path, tp=2, pp=2, dp=16, sp=True, partition="uniform")
    model = dataclasses.replace(cfg.model, vocab_size=64, tie_embeddings=False, block=BlockStructure(final_softcap=3.0))
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, global_batch=32))
    report = step_rank(cfg, cfg.parallel.layout().rank(pp=1), "last stage")
    assert report.activations == report.planned_activations > 0
