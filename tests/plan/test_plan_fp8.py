"""The planner prices model.fp8: the projections' FLOPs at the FP8 peak (H100/H200: twice bf16), nothing else."""

from dataclasses import replace

import pytest

from modelpar.parallel.layout import ParallelLayout
from modelpar.plan import HARDWARE, Strategy, load_model, predict
from modelpar.plan.step_time import fp8_time_factor


def _predictions(hardware: str):
    model = load_model("llama-1b")
    fp8 = replace(model, shape=replace(model.shape, fp8="rowwise"))
    strategy = Strategy(ParallelLayout(tp=2, dp=4), micro_batch_size=1, micro_batches=4)
    return [predict(strategy, m, HARDWARE[hardware], seq_len=2048) for m in (model, fp8)]


def test_fp8_halves_the_projections_time_on_h100_and_leaves_the_rest():
    model = load_model("llama-1b")
    shape = replace(model.shape, fp8="tensorwise")
    share = (
        6 * shape.layers * shape.block_params() / (6 * shape.matmul_params() + 12 * shape.layers * shape.hidden * 2048)
    )
    assert fp8_time_factor(shape, HARDWARE["h100-80gb"], 2048) == pytest.approx(1 - share + share * 989 / 1979)
    bf16, fp8 = _predictions("h100-80gb")
    assert fp8.compute_s < bf16.compute_s
    assert fp8.tp_comm_s == bf16.tp_comm_s and fp8.memory.total == bf16.memory.total
    assert fp8.mfu > bf16.mfu  # MFU stays against the bf16 peak


def test_fp8_changes_nothing_without_fp8_units():
    bf16, fp8 = _predictions("a100-80gb")
    assert fp8.compute_s == bf16.compute_s
