"""Layout planner: memory and step-time formulas, ranking, the CLI, and validation against published runs."""

import dataclasses
import io
import json
import pathlib
import shlex
import statistics
import sys

import pytest

from modelpar.cli.plan import build_parser, main, model_from_args
from modelpar.parallel.layout import ParallelLayout
from modelpar.plan import (
    HARDWARE,
    CostModel,
    SearchSpace,
    Strategy,
    load_model,
    model_presets,
    plan,
    predict,
    stage_memory,
)
from modelpar.plan.memory import activation_bytes_per_layer, chunks_in_flight
from modelpar.plan.published import GPT3_175B, SEQ_LEN, TABLE_1, VOCAB, predicted_tflops
from modelpar.plan.step_time import replicated_elementwise_s

ROOT = pathlib.Path(__file__).resolve().parents[2]

A100 = HARDWARE["a100-80gb"]
LLAMA_8B = load_model("llama-8b")
# the same shape costed as Megatron-LM's GPT block and engine (Korthikanti et al. 2022; bf16 weights + fp32
# masters), as the published runs are; LLAMA_8B is modelpar's own block (modelpar/plan/activations.py)
GPT_8B = dataclasses.replace(LLAMA_8B, block="gpt")


def strategy(tp=1, pp=1, dp=1, vpp=1, b=1, m=8, recompute="none", zero1=False, sp=False) -> Strategy:
    return Strategy(ParallelLayout(tp=tp, pp=pp, dp=dp, vpp=vpp), b, m, recompute, zero1, sp)


# -- validation against Narayanan et al. 2021 ----------------------------------------------------------------

# Published runs (modelpar.plan.published, which names the source): Table 1 of Narayanan et al. 2021 and the paper's
# GPT-3 175B estimate. The planner's efficiency is its default for every row; it was not fitted to them.
TOLERANCE = 0.15


@pytest.mark.parametrize("run", [*TABLE_1, GPT3_175B], ids=lambda r: r.name)
def test_predicted_tflops_per_gpu_match_the_published_runs(run):
    predicted, chosen = predicted_tflops(run)
    assert abs(predicted / run.tflops_per_gpu - 1) < TOLERANCE, (
        f"{chosen}: predicted {predicted:.1f} vs {run.tflops_per_gpu}"
    )
    if run.tp is not None:
        assert (chosen.layout.tp, chosen.layout.pp) == (run.tp, run.pp)


def test_published_rows_are_consistent_with_their_source():
    """Eq. 2 parameter counts match each row's size, and the 1T row's aggregate is the paper's 502 PFLOP/s."""
    for run in TABLE_1:
        h, n_layers = run.hidden, run.layers
        eq2 = 12 * n_layers * h**2 * (1 + 13 / (12 * h) + (VOCAB + SEQ_LEN) / (12 * n_layers * h))
        assert round(eq2 / 1e9, 1) == run.billions, run.name  # the table prints one decimal
    one_t = TABLE_1[-1]  # per-GPU TFLOP/s is printed rounded to a whole number: +-0.5 per GPU
    assert one_t.tflops_per_gpu * one_t.gpus / 1e3 == pytest.approx(502, abs=0.5 * one_t.gpus / 1e3)
    # GPT-3: 8 T P / (n X) with T = 300B tokens is the paper's 34 days
    days = 8 * 300e9 * 175e9 / (GPT3_175B.gpus * GPT3_175B.tflops_per_gpu * 1e12) / 86400
    assert days == pytest.approx(34, abs=0.5)


def test_megatron_table_1_residuals_are_small_on_average():
    residuals = [predicted_tflops(run)[0] / run.tflops_per_gpu - 1 for run in TABLE_1]
    assert statistics.mean(abs(r) for r in residuals) < 0.07
    assert abs(statistics.mean(residuals)) < 0.05  # no large bias either way


@pytest.mark.parametrize("run", [TABLE_1[6], TABLE_1[9]], ids=lambda r: r.name)
def test_planner_choice_fits_and_is_at_least_as_fast_as_the_published_layout(run):
    model, gpus, batch, tp, pp = run.model, run.gpus, run.global_batch, run.tp, run.pp
    # the published runs' own dimensions (no context or expert parallelism at 2048 tokens of a dense model)
    best = plan(model, A100, gpus=gpus, global_batch=batch, seq_len=SEQ_LEN, space=SearchSpace(cp=1, ep=1))[0]
    published = plan(
        model,
        A100,
        gpus=gpus,
        global_batch=batch,
        seq_len=SEQ_LEN,
        space=SearchSpace(tp=tp, pp=pp, recompute=("full",)),
    )[0]
    assert best.prediction.fits and best.prediction.memory.total <= A100.memory_bytes
    assert best.prediction.tokens_per_s >= published.prediction.tokens_per_s
    assert best.strategy.layout.tp <= A100.gpus_per_node  # Narayanan et al. takeaway 1: tp within a node
    assert best.strategy.recompute != "full"  # Korthikanti et al. 2022: selective + SP beats full recompute


# -- memory --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, dtype, per_param",
    [(GPT_8B, "bf16", 18), (GPT_8B, "fp32", 16), (LLAMA_8B, "bf16", 16), (LLAMA_8B, "fp32", 16)],
    ids=["megatron-bf16", "megatron-fp32", "modelpar-bf16", "modelpar-fp32"],
)
def test_model_states_cost_18_bytes_per_param_in_megatron_bf16_and_16_otherwise(model, dtype, per_param):
    """Megatron keeps bf16 weights and fp32 masters; modelpar fp32 parameters whatever the compute dtype."""
    hardware = dataclasses.replace(A100, dtype=dtype)
    mem = stage_memory(model, strategy(), 2048, hardware, stage=0)
    params = mem.grads / 4
    assert params == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B
    assert (mem.weights + mem.grads + mem.optimizer) / params == per_param


@pytest.mark.parametrize("dp", [2, 8])
def test_zero_stages_shard_optimizer_then_gradients_then_weights(dp):
    plain = stage_memory(GPT_8B, strategy(dp=dp), 2048, A100, stage=0)
    z2 = stage_memory(GPT_8B, dataclasses.replace(strategy(dp=dp), zero=2), 2048, A100, stage=0)
    z3 = stage_memory(GPT_8B, dataclasses.replace(strategy(dp=dp), zero=3), 2048, A100, stage=0)
    assert z2.optimizer == pytest.approx(plain.optimizer / dp) and z2.grads == pytest.approx(plain.grads / dp)
    assert z2.weights == plain.weights and z3.grads == z2.grads and z3.activations == plain.activations
    block = (GPT_8B.shape.block_params() + 2 * GPT_8B.shape.hidden) * A100.weight_bytes
    assert z3.weights == pytest.approx(plain.weights / dp) and z3.gathered == pytest.approx(2 * block)


@pytest.mark.parametrize("dp", [2, 8])
def test_our_zero_stages_shard_at_rest_and_gather_during_the_step(dp):
    """modelpar's FSDP2: weights sharded at rest at stage 2 too; stage 2 gathers every weight during the step,
    stage 3 the roots and two blocks; both hold the unsharded gradients while micro-batches accumulate."""
    base = strategy(dp=dp, m=8)
    plain, z1, z2, z3 = (stage_memory(LLAMA_8B, dataclasses.replace(base, zero=z), 2048, A100, 0) for z in range(4))
    assert 0 < plain.buffers < 1e-5 * plain.grads  # the gradients live in the buckets: only their flags are extra
    assert z1.optimizer == pytest.approx(1.5 * plain.optimizer / dp, rel=1e-6)  # moments and the fp32 master shard
    assert z1.grads == pytest.approx(plain.grads * (1 + 1 / dp), rel=1e-6) and z1.weights == plain.weights
    for z in (z2, z3):
        assert z.weights == pytest.approx(plain.weights / dp, rel=1e-3) and z.grads == pytest.approx(
            plain.grads / dp, rel=1e-3
        )
        assert z.optimizer == pytest.approx(plain.optimizer / dp, rel=1e-3) and z.buffers == 0
    # every weight gathered in bf16 and every gradient unsharded in fp32, no regather buffer between micro-batches
    assert z2.gathered == pytest.approx(plain.weights / 2 + plain.grads, rel=1e-6)
    assert plain.grads < z3.gathered < z2.gathered
    assert z3.activations == plain.activations


def test_zero3_pays_weight_gathers_per_micro_batch():
    from modelpar.plan.dp_time import fsdp_traffic_s
    from modelpar.plan.links import group_bandwidth

    base = strategy(dp=8, m=4)
    bw = group_bandwidth(A100, 8)
    moved = {z: fsdp_traffic_s(LLAMA_8B, dataclasses.replace(base, zero=z), A100, 1e11, 8, bw)[0] for z in (2, 3)}
    # stage 2: one fp32 gradient reduce-scatter and one bf16 weight gather (half the bytes) a step, 1 + 1/2;
    # stage 3 gathers before every forward and backward: 1 + 2 * 4 / 2 = 5, so 10/3 the traffic of stage 2
    assert moved[3] == pytest.approx(5 / 1.5 * moved[2], rel=0.01)


def test_fsdp_collectives_hide_behind_the_compute_they_run_beside():
    from modelpar.plan.dp_time import dp_exposed_s, fsdp_traffic_s
    from modelpar.plan.links import group_bandwidth
    from modelpar.plan.memory import stage_params

    z3 = dataclasses.replace(strategy(dp=8, m=4), zero=3)
    params = stage_params(LLAMA_8B, z3.layout, 0, z3.placement)
    moved, first = fsdp_traffic_s(LLAMA_8B, z3, A100, params, 8, group_bandwidth(A100, 8))
    costs = CostModel()
    assert dp_exposed_s(LLAMA_8B, z3, A100, costs, compute_s=0.0) == pytest.approx(moved)  # nothing to hide behind
    assert dp_exposed_s(LLAMA_8B, z3, A100, costs, compute_s=1e6) == pytest.approx(first)  # all but the first gather
    half = dp_exposed_s(LLAMA_8B, z3, A100, costs, compute_s=moved)  # dp_overlap of the compute is usable
    assert half == pytest.approx(moved - costs.dp_overlap * moved, rel=1e-9)
    # ZeRO-2 with one reduce-scatter a step: only one micro-batch's compute runs beside it
    z2 = dataclasses.replace(z3, zero=2)
    moved2, first2 = fsdp_traffic_s(LLAMA_8B, z2, A100, params, 8, group_bandwidth(A100, 8))
    exposed2 = dp_exposed_s(LLAMA_8B, z2, A100, costs, compute_s=4 * moved2)
    assert exposed2 == pytest.approx(moved2 - costs.dp_overlap * moved2, rel=1e-9)


@pytest.mark.parametrize("dp", [2, 8])
def test_zero1_divides_optimizer_state_by_dp_and_nothing_else(dp):
    plain = stage_memory(GPT_8B, strategy(dp=dp), 2048, A100, stage=0)
    zero1 = stage_memory(GPT_8B, strategy(dp=dp, zero1=True), 2048, A100, stage=0)
    assert zero1.optimizer == pytest.approx(plain.optimizer / dp)
    assert (zero1.weights, zero1.grads, zero1.activations) == (plain.weights, plain.grads, plain.activations)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("tp", [2, 8])
def test_sequence_parallel_divides_layer_activations_by_tp(recompute, tp):
    single = activation_bytes_per_layer(LLAMA_8B, strategy(recompute=recompute), 2048, A100)
    sharded = activation_bytes_per_layer(LLAMA_8B, strategy(tp=tp, recompute=recompute, sp=True), 2048, A100)
    assert sharded == pytest.approx(single / tp)


def test_layer_activations_follow_korthikanti_table_2():
    """``activation_bytes_per_layer`` is the GPT block's (``block="gpt"``; our block: plan_memory)."""
    s, b, h, a = 2048, 2, 4096, 32
    none = activation_bytes_per_layer(LLAMA_8B, strategy(b=b), s, A100)
    assert none == s * b * h * (34 + 5 * a * s / h)
    tp4 = activation_bytes_per_layer(LLAMA_8B, strategy(tp=4, b=b), s, A100)
    assert tp4 == pytest.approx(s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert activation_bytes_per_layer(LLAMA_8B, strategy(b=b, recompute="full"), s, A100) == 2 * s * b * h


@pytest.mark.parametrize("sp", [False, True])
def test_recompute_orders_memory_full_below_selective_below_none_and_time_the_other_way(sp):
    by_mode = {
        mode: predict(strategy(tp=2, pp=2, m=8, recompute=mode, sp=sp), LLAMA_8B, A100, seq_len=4096)
        for mode in ("none", "selective", "full")
    }
    act = {mode: p.memory.activations for mode, p in by_mode.items()}
    assert act["full"] < act["selective"] < act["none"]
    step = {mode: p.total_s for mode, p in by_mode.items()}
    assert step["none"] < step["selective"] < step["full"]


def test_flash_attention_drops_the_attention_score_term():
    flash = dataclasses.replace(LLAMA_8B, flash_attention=True)
    assert activation_bytes_per_layer(flash, strategy(), 2048, A100) == activation_bytes_per_layer(
        LLAMA_8B, strategy(recompute="selective"), 2048, A100
    )


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_first_stage_holds_all_layers_of_one_micro_batch_whatever_pp(pp):
    """1F1B: stage 0 keeps p micro-batches of L/p layers, so L layers' worth (Narayanan et al. 2021)."""
    model = GPT_8B  # 32 layers
    per_layer = activation_bytes_per_layer(model, strategy(pp=pp), 2048, A100)
    layers = model.shape.layers
    act = stage_memory(model, strategy(pp=pp, m=16), 2048, A100, stage=0).activations
    embedding_mask = 2048 * model.shape.hidden * pp
    assert act - embedding_mask == pytest.approx(layers * per_layer)


@pytest.mark.parametrize("pp, vpp", [(2, 2), (4, 2), (4, 4)])
def test_interleaving_raises_first_stage_activations_by_1_plus_p_minus_1_over_pv(pp, vpp):
    plain = chunks_in_flight(strategy(pp=pp, m=16), 0) / 1  # chunks of L/p layers
    interleaved = chunks_in_flight(strategy(pp=pp, vpp=vpp, m=16), 0) / vpp  # chunks of L/(pv) layers
    assert interleaved / plain == pytest.approx(1 + (pp - 1) / (pp * vpp))


@pytest.mark.parametrize("pp, vpp, m", [(2, 1, 3), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_chunks_in_flight_match_the_schedule_simulator(pp, vpp, m):
    schedule = pytest.importorskip("modelpar.pipeline.schedule")
    simulate = pytest.importorskip("modelpar.pipeline.simulate")
    actions = schedule.build_schedule("interleaved" if vpp > 1 else "1f1b", pp, m, vpp)
    for stage in range(pp):
        expected = simulate.peak_in_flight(actions[stage])
        assert chunks_in_flight(strategy(pp=pp, vpp=vpp, m=m), stage) == expected


# -- step time -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp, vpp, m", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (8, 4, 32)])
def test_bubble_is_p_minus_1_over_v_m_of_the_busy_time(pp, vpp, m):
    p = predict(strategy(pp=pp, vpp=vpp, m=m), LLAMA_8B, A100, seq_len=2048)
    assert p.bubble_s == pytest.approx((pp - 1) / (vpp * m) * (p.compute_s + p.tp_comm_s))


def test_a_single_device_spends_its_whole_step_computing():
    h200 = HARDWARE["h200"]
    p = predict(strategy(m=4), load_model("llama-1b"), h200, seq_len=2048)
    assert (p.tp_comm_s, p.pp_comm_s, p.dp_comm_s, p.bubble_s) == (0, 0, 0, 0)
    assert p.total_s == p.compute_s
    assert p.mfu == pytest.approx(CostModel().efficiency, rel=0.03)  # element-wise work is ~2% at h=2048
    matmul_only = predict(strategy(m=4), load_model("llama-1b"), dataclasses.replace(h200, memory_bw=0), seq_len=2048)
    assert matmul_only.mfu == pytest.approx(CostModel().efficiency)


def test_tensor_parallelism_repeats_element_wise_work_that_sequence_parallelism_splits():
    cpu = dataclasses.replace(HARDWARE["cpu"], compute_units=0)
    tiny = load_model("bench-tiny")
    parts = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        s = Strategy(ParallelLayout(tp=tp), 2, 8, sp=sp)
        parts[tp, sp] = replicated_elementwise_s(tiny, s, 128, cpu)
    assert parts[1, False] == parts[2, False] > 0
    assert parts[2, True] == pytest.approx(parts[1, False] / 2)


def test_ranks_beyond_the_cores_time_share_them_and_fill_the_bubble():
    tiny, cpu = load_model("bench-tiny"), dataclasses.replace(HARDWARE["cpu"], busy_slowdown=1.0)
    s = Strategy(ParallelLayout(tp=2, pp=2), 2, 8)
    own = predict(s, tiny, dataclasses.replace(cpu, compute_units=0), seq_len=128)
    shared = predict(s, tiny, cpu, seq_len=128)  # 4 ranks on 2 cores
    assert shared.compute_s == pytest.approx(2 * own.compute_s)
    assert shared.bubble_s == 0.0  # the idle stage's cores run the busy one
    assert shared.tp_comm_s == pytest.approx(2 * own.tp_comm_s)  # a message needs both ranks running
    fits = Strategy(ParallelLayout(tp=2), 2, 8)
    assert predict(fits, tiny, cpu, seq_len=128) == predict(
        fits, tiny, dataclasses.replace(cpu, compute_units=0), seq_len=128
    )


def test_ranks_sharing_a_machine_compute_slower_when_more_than_one_is_busy():
    tiny = load_model("bench-tiny")
    calm, busy = (dataclasses.replace(HARDWARE["cpu"], busy_slowdown=f) for f in (1.0, 1.25))
    for layout in (ParallelLayout(tp=2), ParallelLayout(pp=2), ParallelLayout(tp=2, pp=2)):
        s = Strategy(layout, 2, 8)
        assert predict(s, tiny, busy, seq_len=128).compute_s == pytest.approx(
            1.25 * predict(s, tiny, calm, seq_len=128).compute_s
        )
    single = Strategy(ParallelLayout(), 2, 8)
    assert predict(single, tiny, busy, seq_len=128) == predict(single, tiny, calm, seq_len=128)
    gpu = Strategy(ParallelLayout(tp=8), 1, 8)
    h100 = HARDWARE["h100-80gb"]  # a device per rank: nothing shared
    assert predict(gpu, LLAMA_8B, dataclasses.replace(h100, busy_slowdown=1.25), seq_len=2048) == predict(
        gpu, LLAMA_8B, h100, seq_len=2048
    )


def test_tensor_parallelism_across_nodes_pays_inter_node_bandwidth():
    node = dataclasses.replace(A100, latency_s=0.0)
    within = predict(strategy(tp=8, m=4), LLAMA_8B, node, seq_len=2048).tp_comm_s
    across = predict(strategy(tp=8, m=4), LLAMA_8B, dataclasses.replace(node, gpus_per_node=4), seq_len=2048)
    assert across.tp_comm_s / within == pytest.approx(A100.intra_node_bw / A100.inter_node_bw)


def test_dp_overlap_hides_that_fraction_of_the_all_reduce():
    exposed = {
        overlap: predict(strategy(dp=8), LLAMA_8B, A100, seq_len=2048, costs=CostModel(dp_overlap=overlap)).dp_comm_s
        for overlap in (0.0, 0.75)
    }
    assert exposed[0.75] == pytest.approx(exposed[0.0] / 4)


# -- planning ------------------------------------------------------------------------------------------------


def test_plan_returns_only_fitting_layouts_fastest_first():
    planned = plan(LLAMA_8B, HARDWARE["h100-80gb"], gpus=16, global_batch=64, seq_len=4096)
    speeds = [e.prediction.tokens_per_s for e in planned]
    assert speeds == sorted(speeds, reverse=True)
    assert all(e.prediction.memory.total <= HARDWARE["h100-80gb"].memory_bytes for e in planned)
    assert all(e.strategy.global_batch == 64 and e.strategy.layout.world_size == 16 for e in planned)


def test_every_preset_loads_and_plans_on_the_cpu_preset():
    assert set(model_presets()) >= {"tiny", "bench-tiny", "llama-125m", "llama-1b", "llama-8b", "llama-70b"}
    unsharded = SearchSpace(zero=(0,))  # weights and gradients whole: the same bytes in fp32
    best = plan(load_model("bench-tiny"), HARDWARE["cpu"], gpus=4, global_batch=16, seq_len=128, space=unsharded)[0]
    assert best.prediction.memory.weights == pytest.approx(best.prediction.memory.grads)  # fp32 weights on CPU


# -- command line --------------------------------------------------------------------------------------------


def test_cli_prints_a_ranked_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--model", "llama-8b", "--gpus", "16", "--global-batch", "64", "--seq-len", "4096", "--top", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "layouts fit" in lines[0] and "tokens/s" in lines[1]
    assert [line.split()[0] for line in lines[3:6]] == ["1", "2", "3"]
    assert lines[6].startswith("run #1: modelpar-train model=llama-8b parallel.tp=")
    launch = "launch #1: torchrun --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=$HEAD:29500 -m modelpar.cli.train "
    assert lines[7].startswith(launch + "trainer=gpu data=npy data.path=YOUR_TOKENS.npy model=llama-8b parallel.tp=")
    assert lines[7].split(" model=llama-8b ")[1].split("  # ")[0] == lines[6].split(" model=llama-8b ")[1]
    assert lines[8].startswith("why zero-") and lines[9].startswith("why recompute ")
    assert lines[10].startswith("why offload ")
    first = json.loads(out.read_text())["layouts"][0]
    extra = ["why schedule "] * (first["pp"] > 1) + ["why cp comm "] * (first["cp"] > 1)  # one line each
    assert len(lines) == 11 + len(extra) and all(line.startswith(w) for line, w in zip(lines[11:], extra, strict=True))
    record = json.loads(out.read_text())
    first = record["layouts"][0]
    assert first["tp"] * first["cp"] * first["pp"] * first["dp"] == 16
    for key in ("compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s", "total_s", "tokens_per_s", "mfu"):
        assert first[key] >= 0
    assert first["memory"]["total"] <= record["hardware"]["memory_bytes"]


def test_cli_hardware_overrides_reach_the_prediction(tmp_path):
    out = tmp_path / "plan.json"
    argv = ["--model", "tiny", "--gpus", "2", "--global-batch", "8", "--seq-len", "64", "--hardware", "cpu"]
    overrides = ["--peak-tflops", "0.05", "--intra-node-gbs", "2", "--latency-us", "300"]
    assert main([*argv, *overrides, "--json", str(out)]) == 0
    hardware = json.loads(out.read_text())["hardware"]
    assert (hardware["peak_flops"], hardware["intra_node_bw"], hardware["latency_s"]) == (5e10, 2e9, 3e-4)
    assert hardware["dtype"] == "fp32"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "llama-7b", "--gpus", "8"], "unknown model preset 'llama-7b'; choose one of bench-"),
        (["--model", "tiny", "--gpus", "7"], "no tp x pp x dp factorisation of 7 GPUs suits tiny"),
        (["--model", "llama-70b", "--gpus", "8"], "nothing fits in 80.0 GiB per device: the closest"),
        (["--model", "tiny", "--gpus", "0"], "gpus=0 must be a positive integer"),
        (["--model", "tiny", "--gpus", "8", "--tp", "3"], "tp=3 does not divide gpus=8"),
        (["--model", "tiny", "--gpus", "8", "--hardware", "tpu"], "unknown hardware preset 'tpu'"),
        (["--model", "tiny", "--gpus", "8", "--recompute", "some"], "recompute=['some'] must list modes"),
        (["--model", "tiny", "--gpus", "8", "--memory-gib", "0"], "--memory-gib=0.0 must be positive"),
    ],
)
def test_cli_rejects_bad_input_with_one_clear_line(args, needle, capsys):
    assert main(["--global-batch", "16", "--seq-len", "128", "--hardware", "a100-80gb", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1


def test_no_layout_names_the_constraint_that_failed(capsys):
    """A BLOOM-176B-like shape at --tp 4 --pp 12 --dp 8: tp=4 divides the 112 heads but not ffn_hidden=38229."""
    args = ["--model", "llama-70b", "--hidden", "14336", "--heads", "112", "--kv-heads", "112", "--ffn-hidden", "38229",
            "--layers", "70", "--tp", "4", "--pp", "12", "--dp", "8", "--gpus", "384"]  # fmt: skip
    assert main(["--global-batch", "2048", "--seq-len", "2048", "--hardware", "a100-80gb", *args]) == 2
    err = capsys.readouterr().err
    assert "tp=4 does not divide ffn_hidden=38229" in err and err.count("\n") == 1, err


def test_cli_refuses_a_preset_with_a_mistyped_field_as_the_trainer_does(tmp_path, monkeypatch, capsys):
    import shutil

    import modelpar.plan.presets as planner

    recipes = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    (recipes / "model" / "typo.yaml").write_text("name: typo\nvocab_size: 256\nhiden: 64\n")
    monkeypatch.setattr(planner, "MODEL_PRESET_DIR", recipes / "model")
    assert main(["--model", "typo", "--gpus", "2", "--global-batch", "8", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "model preset 'typo' (recipes/model/typo.yaml): Key 'hiden' not in 'ModelConfig'" in err
    assert err.count("\n") == 1


def test_nothing_fits_names_the_shortfall(capsys):
    main(["--model", "llama-70b", "--gpus", "8", "--global-batch", "16", "--seq-len", "4096"])
    err = capsys.readouterr().err
    need, short = (float(err.split(word)[1].split()[0]) for word in ("needs", "missing by"))
    assert need - short == pytest.approx(80.0, abs=0.1)


def test_plan_vs_published_script_reports_each_row_with_its_residual():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "plan_vs_published.py"
    spec = importlib.util.spec_from_file_location("plan_vs_published", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    row = script.compare(TABLE_1[0])
    predicted, _ = predicted_tflops(TABLE_1[0])
    assert row["residual"] == pytest.approx(predicted / 137 - 1)
    assert row["published_layout"] == {"tp": 1, "pp": 1}
    assert row["planner_choice_step_s"] <= row["published_layout_step_s"]  # its choice is never predicted slower
    table = script.markdown([row])
    assert "| 1.7B (Table 1) | 32 | 512 | 1 x 1 | 137 |" in table


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_cli_names_the_trainer_overrides_that_run_the_best_layout_and_they_validate(tmp_path, capsys, recompute):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.training.config import register_schema, validate

    register_schema()
    out = tmp_path / "plan.json"
    argv = ["--model", "tiny", "--gpus", "4", "--global-batch", "16", "--seq-len", "64", "--hardware", "cpu"]
    assert main([*argv, "--recompute", recompute, "--layers", "8", "--json", str(out)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run #1: ")]
    assert line.startswith("run #1: modelpar-train ")
    overrides = shlex.split(line.removeprefix("run #1: modelpar-train "))
    # the list override is quoted: unquoted, a shell reads [elementwise] as a glob
    assert ("'parallel.recompute_modules=[" in line) == (recompute == "selective")
    assert overrides[:2] == ["model=tiny", "model.layers=8"] and f"parallel.recompute={recompute}" in overrides
    assert any(o.startswith("parallel.recompute_modules=[") for o in overrides) == (recompute == "selective")
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=[*overrides, f"trainer.out_dir={tmp_path}"]))
    layout = validate(cfg)
    best = json.loads(out.read_text())["layouts"][0]
    assert (layout.tp, layout.pp, layout.dp, layout.vpp) == (best["tp"], best["pp"], best["dp"], best["vpp"])
    assert cfg.parallel.microbatches == best["micro_batches"] and cfg.data.global_batch == 16
    assert best["trainer_overrides"] == overrides[2:]
    assert cfg.parallel.recompute == best["recompute"] and cfg.parallel.recompute_modules == (
        best["recompute_modules"] or cfg.parallel.recompute_modules
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_cli_shows_search_progress_on_a_terminal_only(terminal, capsys, monkeypatch):
    argv = ["--model", "tiny", "--gpus", "2", "--global-batch", "16", "--seq-len", "128", "--hardware", "cpu"]
    assert main(argv) == 0
    plain = capsys.readouterr()
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(argv) == 0
    assert capsys.readouterr().out == plain.out  # the table and run line never change
    if terminal:
        assert "modelpar-plan: searching" in err.getvalue() and "layout/s" in err.getvalue()
    else:
        assert err.getvalue() == ""


def test_cpu_preset_ranks_zero0_over_zero2_over_zero3_at_dp2_as_measured():
    # benchmarks/results/bench_zero_speed.md, bench-tiny at dp2 on this machine: zero-0 2,422 tokens/s, zero-2
    # 2,102, zero-3 1,212. Stage 2 gathers its weights once a step besides the reduce-scatter, as the engine does.
    argv = ["--model", "tiny", "--gpus", "2", "--global-batch", "16", "--seq-len", "128", "--hardware", "cpu"]
    model = model_from_args(build_parser().parse_args(argv))
    best = {}
    for entry in plan(model, HARDWARE["cpu"], gpus=2, global_batch=16, seq_len=128):
        if entry.strategy.layout.dp == 2 and entry.strategy.zero != 1:
            best.setdefault(entry.strategy.zero, entry.prediction.tokens_per_s)
    assert best[0] > best[2] > best[3]
