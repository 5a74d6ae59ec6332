"""The dry run's per-rank report adds up for a reader: the total that ``fits`` judges is printed, and a
collective too small to be judged shows no error figure beside a summary that leaves it out."""

from __future__ import annotations

from modelpar.bench.dry_run import RankReport, format_report

GIB = 2**30


def _report() -> RankReport:
    states = {"weights": 2 * GIB, "gradients": 2 * GIB, "optimizer": 4 * GIB, "gathered": 0}
    return RankReport(
        rank=0, role="first stage", stage=0, states=states, planned_states=dict(states), activations=GIB,
        planned_activations=GIB, traffic={"dp all_reduce": 2**31, "pp all_reduce": 8},
        planned_traffic={"dp all_reduce": 2**31}, planned_activations_bf16=0.5 * GIB,
    )  # fmt: skip


def test_the_bf16_total_that_fits_judges_is_printed():
    lines = format_report(_report())
    (total,) = [line for line in lines if "total of the bf16 step on a GPU" in line]
    assert "8.500" in total and "fits judges this" in total


def test_a_collective_too_small_to_judge_shows_no_error():
    report = _report()
    assert report.comm_rel_err == 0.0
    lines = format_report(report)
    (row,) = [line for line in lines if line.strip().startswith("pp all_reduce")]
    assert row.rstrip().endswith("-") and "%" not in row
    assert any("listed, not judged" in line for line in lines)
