"""Two dp replicas cannot say which one is odd, but can say that they disagree; a check the layout cannot run
is said at start-up in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from modelpar.training.outliers import GradientOutlierCheck, outlier_check_note


def _two_replica_check() -> GradientOutlierCheck:
    check = object.__new__(GradientOutlierCheck)  # the verdict reads the gathered statistics only
    check.dp, check.cosine_gap, check.norm_max = 2, 0.5, 10.0
    check.groups = SimpleNamespace(dp_ranks=[0, 1])
    return check


@pytest.mark.parametrize(
    ("stats", "disagree"),
    [
        ([0.8, 1.0, 1.0, 0.8, 1.1, 1.1], False),  # alike
        ([-0.9, 1.0, 1.0, -0.9, 1.0, 1.0], True),  # one of them sign-flipped
        ([0.7, 1.0, 1.0, 0.7, 40.0, 40.0], True),  # one of them scaled
    ],
)
def test_two_replicas_report_disagreement_without_naming_one(stats, disagree):
    message = _two_replica_check().verdict(stats, step=4)
    assert (message is not None) == disagree
    if disagree:
        assert message.startswith("gradient disagreement at step 5 between the two dp replicas (ranks 0 and 1)")


def test_a_check_the_layout_cannot_run_is_said_at_start_up():
    assert "inactive: with dp=1" in outlier_check_note("halt", 1, 0)
    assert "inactive under optim.zero=3" in outlier_check_note("skip", 4, 3)
    assert "at dp=2 reports replicas that disagree" in outlier_check_note("halt", 2, 0)
    assert outlier_check_note("warn", 1, 0) is None and outlier_check_note("halt", 4, 1) is None
