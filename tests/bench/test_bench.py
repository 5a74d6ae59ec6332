"""modelpar-bench: layouts parse, the meters count what they claim, a tiny sweep reports every field, and the
PyTorch peers start from our weights (their first loss equals ours). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from modelpar.bench.layout_spec import layout_name, parse_layout
from modelpar.bench.meters import SavedTensorMeter
from modelpar.bench.peers import regroup_rows
from modelpar.training.config import ParallelConfig
from tests import warm_cli
from tests.helpers import tiny_bench_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("single", dict(tp=1, pp=1, dp=1, vpp=1, schedule="1f1b")),
        ("tp2-pp2", dict(tp=2, pp=2, schedule="1f1b")),
        ("pp2-vpp2", dict(pp=2, vpp=2, schedule="interleaved")),
        ("pp2-zb-h1-m4", dict(pp=2, schedule="zb-h1", microbatches=4)),
        ("tp2-sp", dict(tp=2, sp=True)),
        ("tp2-native", dict(tp=2, collectives="native")),
        ("pp2-blocks", dict(pp=2, partition="blocks")),
        ("single-rc", dict(tp=1, pp=1, recompute="full")),
        ("tp2-pp2-rc", dict(tp=2, pp=2, recompute="full")),
        ("tp2", dict(tp=2, recompute="none")),
        ("single-sel", dict(recompute="selective", recompute_modules=["elementwise"])),
        ("tp2-sel.attention.mlp", dict(tp=2, recompute="selective", recompute_modules=["attention", "mlp"])),
        ("pp2-off", dict(pp=2, offload_activations=True)),
    ],
)
def test_layout_specs_set_the_parallel_config(spec, want):
    got = parse_layout(spec, ParallelConfig(microbatches=8))
    assert {k: getattr(got, k) for k in want} == want


def test_layout_name_reads_back_as_the_same_layout():
    for spec in (
        "single",
        "tp2",
        "pp2-gpipe",
        "pp2-vpp2-interleaved",
        "dp2",
        "tp2-pp2-1f1b-m4",
        "tp2-sp",
        "tp2-native",
        "pp2-uniform",
        "pp2-params",
        "single-rc",
        "tp2-pp2-zb-h1-m4-rc",
        "single-sel",
        "tp2-sp-sel.mlp.elementwise-off",
    ):
        parallel = parse_layout(spec, ParallelConfig(microbatches=8))
        assert parse_layout(layout_name(parallel), ParallelConfig(microbatches=8)) == parallel


def test_unknown_layout_token_is_one_line_with_the_fix():
    with pytest.raises(ValueError, match="cannot read 'xx3'.*tpN"):
        parse_layout("tp2-xx3", ParallelConfig())
    with pytest.raises(ValueError, match=r"'sel.atn' names \['atn'\]; selective recompute reruns some of"):
        parse_layout("single-sel.atn", ParallelConfig())


def test_case_specs_set_the_optimizer_too_and_name_it():
    from modelpar.bench.layout_spec import case_name, parse_case
    from modelpar.training.config import TrainConfig

    cfg = parse_case("dp4-zero3-zg2-sel", TrainConfig())
    assert (cfg.parallel.dp, cfg.optim.zero, cfg.optim.zero_group, cfg.parallel.recompute) == (4, 3, 2, "selective")
    assert case_name(cfg) == "dp4-m1-sel-zero3-zg2"
    assert parse_case(case_name(cfg), TrainConfig()) == cfg


def test_saved_tensor_meter_counts_each_storage_once_and_frees_after_backward():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedTensorMeter(exclude=[w])
    with meter:
        h = x @ w  # saves x (and w: excluded)
        y = (h * h).sum()  # saves h twice: one storage
    assert meter.live == x.numel() * 4 + h.numel() * 4
    y.backward()
    del y, h
    assert meter.live == 0
    assert meter.peak == x.numel() * 4 + 4 * 8 * 4


def test_regrouped_fused_weight_shards_like_our_tensor_parallel_layer():
    q, k, v = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    regrouped = regroup_rows(torch.cat([q, k, v]), [8, 4, 4], tp=2)
    for rank in range(2):
        ours = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
        assert torch.equal(regrouped.chunk(2)[rank], ours)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    from modelpar.bench.harness import run

    tmp = tmp_path_factory.mktemp("bench")
    run(tiny_bench_config(tmp))
    return tmp


@pytest.mark.parametrize(
    "layout, counts, peer_partition, peer_name",
    [
        ("pp2-1f1b", "3,1", "uniform", "torch.pipelining 1f1b (uniform split)"),
        ("pp2-1f1b", "2.5,1.5", "same", "torch.pipelining 1f1b"),  # the peer's stages cut inside block 2 too
        ("tp2-pp2-1f1b", "1.5,2.5", "same", "torch.pipelining 1f1b + DTensor TP"),  # DTensor plan on half blocks
    ],
)
def test_peer_on_another_or_a_half_block_split_computes_the_same_losses(
    tmp_path, layout, counts, peer_partition, peer_name
):
    from modelpar.bench.harness import run

    cfg = tiny_bench_config(
        tmp_path,
        f"bench.sweep=[{layout}]",
        "parallel.partition=explicit",
        f"parallel.stage_layers=[{counts}]",
        f"bench.peer_partition={peer_partition}",
    )
    row = run(cfg)[f"{layout}-m4-split{counts.replace(',', '+')}"]
    assert row["peer_name"] == peer_name
    assert row["losses_agree"] and row["first_loss_rel_diff"] <= 1e-5


def test_torchs_own_v_schedules_are_raced_and_compute_the_same_losses(tmp_path):
    from modelpar.bench.harness import run

    rows = run(tiny_bench_config(tmp_path, "bench.sweep=[pp2-vpp2-zbv,pp2-vpp2-dualpipev]"))
    for name in ("zbv", "dualpipev"):
        (row,) = [r for key, r in rows.items() if key.startswith(f"pp2-vpp2-{name}")]
        assert row["peer_name"] == f"torch.pipelining {name}"
        assert row["losses_agree"] and row["first_loss_rel_diff"] <= 1e-5


@pytest.mark.parametrize(
    "override, message",
    [
        ("bench.peer_partition=even", "bench.peer_partition='even' must be 'same' or 'uniform'"),
        ("bench.rounds=0", r"bench.rounds=0 must be a whole number >= 1 \(nothing would be timed\)"),
        ("bench.steps_per_round=0", "bench.steps_per_round=0 must be a whole number >= 1"),
        ("bench.passes=-1", "bench.passes=-1 must be a whole number >= 1"),
        ("bench.warmup=0", "bench.warmup=0 must be a whole number >= 1: each side's first step is always untimed"),
        ("bench.peak_tflops=-1", r"bench.peak_tflops=-1.0 must be > 0 TFLOP/s per rank, or 0 to measure it"),
        ("bench.timeout_s=0", "bench.timeout_s=0.0 must be > 0 seconds"),
        ("bench.profile_rank=-2", r"bench.profile_rank=-2 must be a rank \(>= 0\), or -1 for no profile"),
        ("bench.profile_rank=2", r"bench.profile_rank=2 is not a rank of any layout \(at most 2 ranks\)"),
        ("bench.name=a/b", "bench.name='a/b' must be a plain file stem"),
    ],
)
def test_bad_bench_options_are_refused_before_any_rank_starts(tmp_path, override, message):
    from modelpar.bench.harness import run

    cfg = tiny_bench_config(tmp_path, override)
    cfg.bench.results_dir = str(tmp_path / "results")
    with pytest.raises(ValueError, match=message):
        run(cfg)
    assert not (tmp_path / "results").exists()  # nothing ran, nothing written


def test_sweep_writes_every_field_per_layout(tiny_sweep):
    rows = json.loads((tiny_sweep / "bench.json").read_text())["rows"]
    assert set(rows) == {"single-m4", "tp2-m4", "pp2-1f1b-m4"}
    for row in rows.values():
        for side in ("ours", "peer"):
            assert row[side]["tokens_per_s"] > 0 and row[side]["tflops_per_rank"] > 0
        assert row["ours"]["mfu"] == pytest.approx(row["ours"]["tflops_per_rank"] / 0.1)
        assert row["ratio"] > 0
        assert 0 <= row["bubble_measured"] < 1 and 0 <= row["bubble_simulated"] < 1
        assert len(row["activation_peak_bytes_per_stage"]) == row["pp"]
        assert all(b > 0 for b in row["activation_peak_bytes_per_stage"])
    assert rows["pp2-1f1b-m4"]["comm_bytes_per_step"]["p2p_send"] > 0
    assert rows["tp2-m4"]["comm_bytes_per_step"]["all_reduce"] > 0
    assert rows["pp2-1f1b-m4"]["fraction_of_ideal"] > 0
    assert (tiny_sweep / "bench_timeline_pp2-1f1b-m4.png").is_file()
    assert (tiny_sweep / "bench_throughput.png").is_file()
    assert "| pp2-1f1b-m4 |" in (tiny_sweep / "bench.md").read_text()


@pytest.mark.parametrize("layout", ["single-m4", "tp2-m4", "pp2-1f1b-m4"])
def test_peer_starts_from_our_weights_and_data(tiny_sweep, layout):
    row = json.loads((tiny_sweep / "bench.json").read_text())["rows"][layout]
    assert row["first_loss_rel_diff"] <= 1e-5
    assert row["losses_agree"]


def test_gpu_script_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "mfu.json"
    script = ROOT / "benchmarks" / "gpu_llama1b_mfu.py"
    warm_cli.run([sys.executable, str(script), "--smoke", "--out", str(out)], check=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["model"] == "smoke" and result["tokens_per_s"] > 0 and result["mfu_vs_measured_peak"] > 0


def test_multirun_benches_one_layout_per_job_and_merges_the_rows(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint16))
    overrides = [
        "-m",
        "parallel=single,pp2",
        "model=tiny",
        "model.tie_embeddings=false",
        "data.seq_len=16",
        "data.global_batch=8",
        f"data.path={tokens}",
        "parallel.microbatches=4",
        "bench.peer=false",
        "bench.rounds=1",
        "bench.steps_per_round=1",
        "bench.passes=1",
        "bench.peak_tflops=0.1",
        f"hydra.sweep.dir={tmp_path / 'hydra'}",
    ]  # no bench.results_dir: the sweep's directory, never the committed benchmarks/results
    status = ["git", "status", "--porcelain", "--untracked-files=all", "benchmarks/results"]
    before = subprocess.run(status, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.bench", *overrides],
        check=True, timeout=300, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    sweep = tmp_path / "hydra"
    rows = json.loads((sweep / "bench.json").read_text())["rows"]
    assert set(rows) == {"single-m4", "pp2-1f1b-m4"}
    assert rows["pp2-1f1b-m4"]["peer"] is None
    assert subprocess.run(status, cwd=ROOT, capture_output=True, text=True, check=True).stdout == before
    wrote = [line for line in proc.stdout.splitlines() if line.startswith("modelpar-bench: wrote ")]
    assert len(wrote) == 2  # one line per job, naming every file it wrote
    named = {p for line in wrote for p in line.removeprefix("modelpar-bench: wrote ").split(", ")}
    expected = {"bench.json", "bench.md", "bench_throughput.png", "bench_timeline_pp2-1f1b-m4.png"}
    assert named == {str(sweep / name) for name in expected}


def _live_after_each_weight_backward(cfg, data_path):
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    meter = SavedTensorMeter([p for p, _ in trainer.model.params])
    weight_backward, live = trainer.runtime._weight_backward, []

    def recorded(action, state):
        weight_backward(action, state)
        live.append(meter.live)

    trainer.runtime._weight_backward = recorded
    with meter:
        trainer.train_step()
    return live


def test_zero_bubble_frees_each_micro_batch_at_its_weight_backward(tmp_path):
    """Saved activations do not pile up on the last stage: after every W the same bytes are live."""
    import numpy as np

    from modelpar.testing import run_on_ranks
    from modelpar.training.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig, TrainerConfig

    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 97, size=20000, dtype=np.uint16))
    cfg = TrainConfig(
        model=ModelConfig(
            vocab_size=97, hidden=32, layers=4, heads=4, kv_heads=4, ffn_hidden=64, max_seq_len=32, tie_embeddings=True
        ),
        parallel=ParallelConfig(pp=2, schedule="zb-h1", microbatches=6),
        data=DataConfig(seq_len=32, global_batch=12),
        trainer=TrainerConfig(out_dir=str(tmp_path), progress=False),
    )
    _, last_stage = run_on_ranks(2, _live_after_each_weight_backward, cfg, str(data))
    steady = last_stage[:-1]  # the last W leaves nothing in flight
    assert len(set(steady)) == 1, f"live saved bytes grew across micro-batches: {steady}"
    assert last_stage[-1] == 0


def test_round_ratios_pair_each_round_of_ours_with_the_peers():
    from modelpar.bench.summary import paired_round_ratios

    ours = [1.0, 1.2, 2.0, 2.2]  # round 2 ran on a slower machine for both
    peer = [1.5, 1.7, 2.2, 2.4]
    assert paired_round_ratios(ours, peer, 2) == pytest.approx([1.6 / 1.1, 2.3 / 2.1])
    with pytest.raises(ValueError, match="do not split into rounds of 3"):
        paired_round_ratios(ours, peer, 3)


def test_ratio_cell_shows_the_spread_over_rounds(tiny_sweep):
    from modelpar.bench.report import _ratio_cell

    assert _ratio_cell({"ratio": 1.5, "ratio_per_round": [1.4, 1.62, 1.5]}) == "1.50x (1.40-1.62)"
    assert _ratio_cell({"ratio": 1.5, "ratio_per_round": [1.5]}) == "1.50x"
    assert _ratio_cell({"ratio": None}) == "-"
    saved = json.loads((tiny_sweep / "bench.json").read_text())
    rounds = saved["bench"]["rounds"] * saved["bench"]["passes"]  # every pass runs its own rounds
    assert rounds > 1
    assert all(len(row["ratio_per_round"]) == rounds for row in saved["rows"].values())


def _tp_breakdown_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tp_breakdown

    return tp_breakdown


def _skipped_sums() -> dict:
    from modelpar.parallel import collectives
    from modelpar.testing import current_groups

    groups = current_groups()
    mine = torch.full((4,), float(torch.distributed.get_rank() + 1))
    undo = _tp_breakdown_module().skip_tp_collectives(groups.tp_group)
    try:
        skipped_tp = collectives.all_reduce(mine.clone(), groups.tp_group)
        skipped_async = mine.clone()
        collectives.all_reduce_async(skipped_async, groups.tp_group).wait()
        other = collectives.all_reduce(mine.clone(), groups.dp_group)
    finally:
        undo()
    real_tp = collectives.all_reduce(mine.clone(), groups.tp_group)
    return {"skipped_tp": skipped_tp[0].item(), "skipped_async": skipped_async[0].item(), "dp": other[0].item()} | {
        "real_tp": real_tp[0].item()
    }


def test_tp_breakdown_skips_only_the_tp_groups_collectives_and_undoes_it():
    from modelpar import ParallelLayout
    from modelpar.testing import run_on_ranks

    out = run_on_ranks(4, _skipped_sums, layout=ParallelLayout(tp=2, dp=2))
    for rank, got in enumerate(out):  # tp pairs (0, 1) and (2, 3); dp pairs (0, 2) and (1, 3); values rank + 1
        tp_sum = sum(r + 1 for r in range(4) if r // 2 == rank // 2)
        dp_sum = sum(r + 1 for r in range(4) if r % 2 == rank % 2)
        assert got == {"skipped_tp": rank + 1, "skipped_async": rank + 1, "dp": dp_sum, "real_tp": tp_sum}


def test_tp_breakdown_script_times_both_modes_per_layout(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint16))
    sets = ["model=tiny", "data.seq_len=16", "data.global_batch=8", "parallel.microbatches=4", f"data.path={tokens}"]
    sets.append(f"trainer.out_dir={tmp_path / 'run'}")
    args = ["--layouts", "single", "tp2-sp", "--rounds", "2", "--steps", "1", "--results-dir", str(tmp_path)]
    _tp_breakdown_module().main(args + [a for s in sets for a in ("--set", s)])
    rows = {r["layout"]: r for r in json.loads((tmp_path / "tp_breakdown.json").read_text())["rows"]}
    assert set(rows) == {"single-m4", "tp2-sp-m4"}
    assert "timing_only" not in rows["single-m4"] and rows["single-m4"]["trained"]["step_s"] > 0
    tp = rows["tp2-sp-m4"]
    assert tp["trained"]["step_s"] > 0 and tp["timing_only"]["step_s"] > 0
    assert tp["tp_comm_and_wait_s"] == pytest.approx(tp["trained"]["step_s"] - tp["timing_only"]["step_s"])
    assert tp["compute_scaling"] == pytest.approx(
        tp["timing_only"]["step_s"] * 2 / rows["single-m4"]["trained"]["step_s"]
    )
    assert "| tp2-sp-m4 | 2 |" in (tmp_path / "tp_breakdown.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "model=nope"], "--set: In 'bench': Could not find 'model/nope'"),
        (["--set", "trainer.log_every=0"], "trainer.log_every=0 must be >= 1"),
        (["--set", "data.path=/no/such/tokens.npy"], "token file /no/such/tokens.npy does not exist"),
        (["--layouts", "tp3"], "tp=3 does not divide heads=8"),
        (["--rounds", "0"], "argument --rounds: '0' is not a positive integer"),
    ],
)
def test_tp_breakdown_refuses_bad_input_in_one_line_before_any_rank(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        _tp_breakdown_module().main([*argv, "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tp_breakdown.py: error: ") and message in err
    assert not list(tmp_path.iterdir())


def test_recompute_row_holds_less_activation_memory_and_has_no_peer(tmp_path):
    from modelpar.bench.harness import run

    rows = run(tiny_bench_config(tmp_path, "bench.sweep=[pp2-1f1b,pp2-1f1b-rc]"))
    plain, rc = rows["pp2-1f1b-m4"], rows["pp2-1f1b-m4-rc"]
    assert rc["peer_name"] is None and rc["peer"] is None  # the peers have no recompute to compare with
    assert plain["peer"] is not None
    for held, held_rc in zip(
        plain["activation_peak_bytes_per_stage"], rc["activation_peak_bytes_per_stage"], strict=True
    ):
        assert 0 < held_rc < held / 2
    assert rc["comm_bytes_per_step"]["p2p_send"] == plain["comm_bytes_per_step"]["p2p_send"]
