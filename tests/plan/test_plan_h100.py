"""The planner against published H100 runs (modelpar.plan.published: Llama 3 405B from the Llama 3 paper's Table 4,
Llama 3.1 8B from torchtitan's benchmarks), at the default costs the A100 rows use."""

from __future__ import annotations

import pytest

from modelpar.plan.published import H100_RUNS, LLAMA3_405B, TORCHTITAN_8B, h100_residual, llama3_shape

# today's residuals (benchmarks/results/plan_vs_published_h100.md); a change to the step-time model that moves one
# by more than PINNED_TO must update that table and this list together
RESIDUALS = {
    "Llama 3 405B, 8K GPUs": -0.023,
    "Llama 3 405B, 16K GPUs": -0.058,
    "Llama 3 405B, 16K GPUs, 128K context": +0.065,
    "Llama 3.1 8B, torchtitan FSDP": +0.532,
}
PINNED_TO = 0.015


def test_published_h100_rows_are_consistent_with_their_source():
    for run in LLAMA3_405B:
        assert run.tp * run.cp * run.pp * run.dp == run.gpus
        assert run.global_batch * run.seq_len == 16 * 2**20  # Table 4's 16M-token batches
    assert [(r.gpus, r.cp, r.dp, r.tflops_per_gpu) for r in LLAMA3_405B] == [
        (8192, 1, 64, 430),
        (16384, 1, 128, 400),
        (16384, 16, 8, 380),
    ]
    # the paper's Table 3 shapes: 405B and 8B parameters (matmul weights, the head, and the untied embedding)
    for billions in (405, 8):
        shape = llama3_shape(billions)
        params = shape.matmul_params() + shape.vocab_size * shape.hidden
        assert params == pytest.approx(billions * 1e9, rel=0.01)


@pytest.mark.parametrize("run", H100_RUNS, ids=lambda r: r.name)
def test_h100_residuals_are_pinned(run):
    _, residual = h100_residual(run)
    assert residual == pytest.approx(RESIDUALS[run.name], abs=PINNED_TO)


@pytest.mark.parametrize("run", LLAMA3_405B, ids=lambda r: r.name)
def test_llama3_405b_is_predicted_within_10_percent(run):
    assert abs(h100_residual(run)[1]) <= 0.10


def test_torchtitan_8b_is_over_predicted_a_known_gap():
    # 500 W power cap, eager PyTorch: the source's own 33-39% MFU; the planner's 0.55 efficiency does not describe it
    assert h100_residual(TORCHTITAN_8B)[1] > 0.3


def test_plan_vs_published_script_writes_the_h100_rows():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "plan_vs_published.py"
    spec = importlib.util.spec_from_file_location("plan_vs_published", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    row = script.compare_h100(LLAMA3_405B[0])
    assert row["residual"] == pytest.approx(h100_residual(LLAMA3_405B[0])[1])
    assert set(row["residual_by_vpp"]) == {2, 4, 8}
    assert "| Llama 3 405B, 8K GPUs (Table 4) | 8,192 | tp8-pp16-dp64-vpp4" in script.markdown_h100([row])
