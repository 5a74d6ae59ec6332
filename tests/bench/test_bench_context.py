"""modelpar-bench's context-parallel rows: cp layouts parse and name themselves, and a tiny sweep reports the
activation memory a cp rank holds, the K/V exchange's bytes by kind, the cp ideal, and why PyTorch's own
context parallelism is not raced."""

from modelpar.bench.layout_spec import layout_name, parse_layout
from modelpar.training.config import ParallelConfig
from tests.helpers import tiny_bench_config


def test_cp_specs_set_cp_and_the_exchange_and_read_back():
    base = ParallelConfig(microbatches=8)
    assert (parse_layout("cp2", base).cp, parse_layout("cp2", base).cp_comm) == (2, "ring")
    got = parse_layout("tp2-cp2-allgather", base)
    assert (got.tp, got.cp, got.cp_comm) == (2, 2, "allgather")
    for spec in ("cp2", "cp4-allgather", "tp2-cp2-pp2-1f1b-m4", "cp2-dp2", "cp2-alltoall", "cp4-hybrid2"):
        parallel = parse_layout(spec, base)
        assert layout_name(parallel) == spec and parse_layout(layout_name(parallel), base) == parallel
    assert (parse_layout("cp4-hybrid2", base).cp_comm, parse_layout("cp4-hybrid2", base).cp_a2a) == ("hybrid", 2)


def test_cp_rows_hold_half_the_activations_and_count_the_kv_exchange(tmp_path):
    from modelpar.bench.harness import run

    rows = run(tiny_bench_config(tmp_path, "bench.sweep=[single,cp2,cp2-allgather]", "data.seq_len=32"))
    single, ring, gather = rows["single-m4"], rows["cp2-m4"], rows["cp2-allgather-m4"]
    for row in (ring, gather):
        assert row["cp"] == 2 and row["peer"] is None
        assert row["peer_note"].startswith("torch context_parallel on cpu: ")
        assert "\n" not in row["peer_note"]
        assert 0 < row["activation_peak_bytes_per_stage"][0] < 0.6 * single["activation_peak_bytes_per_stage"][0]
        assert row["cp_ideal_tokens_per_s"] == 2 * single["ours"]["tokens_per_s"]
        assert row["fraction_of_ideal"] > 0
    assert ring["cp_comm"] == "ring" and ring["comm_bytes_per_step"]["send_recv"] > 0
    assert "all_gather" not in ring["comm_bytes_per_step"]
    assert gather["comm_bytes_per_step"]["all_gather"] > 0 and "send_recv" not in gather["comm_bytes_per_step"]
