"""The simulator: exact bubble and memory numbers for known schedules, and deadlocks caught with a table."""

from __future__ import annotations

from fractions import Fraction

import pytest

from modelpar.pipeline.actions import Action, ScheduleError
from modelpar.pipeline.gantt import render_png, render_text
from modelpar.pipeline.schedule import build_schedule
from modelpar.pipeline.simulate import Costs, ScheduleDeadlock, compute_timeline, simulate

GRID = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


def bubble_1f1b(pp: int, m: int) -> Fraction:
    return Fraction(pp - 1, m + pp - 1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", GRID)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, pp, m):
    got = simulate(build_schedule(name, pp, m)).bubble_fraction
    assert got == pytest.approx(float(bubble_1f1b(pp, m)), abs=1e-12)


@pytest.mark.parametrize("pp, m", [(pp, m) for pp, m in GRID if m % pp == 0])
def test_interleaved_bubble_is_strictly_smaller_than_1f1b(pp, m):
    assert simulate(build_schedule("interleaved", pp, m, vpp=2)).bubble_fraction < float(bubble_1f1b(pp, m))


@pytest.mark.parametrize("pp, m", GRID)
def test_zero_bubble_h1_bubble_is_strictly_smaller_than_1f1b(pp, m):
    assert simulate(build_schedule("zb-h1", pp, m)).bubble_fraction < float(bubble_1f1b(pp, m))


@pytest.mark.parametrize("pp, m", [(pp, m) for pp, m in GRID if m >= pp])
def test_zero_bubble_h1_reaches_its_unit_cost_makespan(pp, m):
    """F = B = W = 1: bubble (p-1)(F+B-W) = p-1 per rank, so the step takes 3m + p - 1."""
    assert simulate(build_schedule("zb-h1", pp, m)).makespan == 3 * m + pp - 1


@pytest.mark.parametrize("pp, m", GRID)
def test_1f1b_holds_min_m_p_minus_i_micro_batches_on_stage_i(pp, m):
    assert simulate(build_schedule("1f1b", pp, m)).peak_in_flight == tuple(min(m, pp - i) for i in range(pp))


@pytest.mark.parametrize("pp, m", GRID)
def test_gpipe_holds_all_m_micro_batches(pp, m):
    assert simulate(build_schedule("gpipe", pp, m)).peak_in_flight == (m,) * pp


@pytest.mark.parametrize("pp, m", GRID)
def test_zero_bubble_h1_peak_matches_1f1b_peak(pp, m):
    assert max(simulate(build_schedule("zb-h1", pp, m)).peak_in_flight) == min(m, pp)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_placed_communication_costs_nothing_over_the_ideal_compute_timeline(name):
    schedule = build_schedule(name, 4, 6)
    assert simulate(schedule).makespan == compute_timeline(schedule).end


def test_latency_delays_each_stage_boundary():
    costs = Costs(latency=0.5)
    # one micro-batch through 3 stages: 3 forwards, 2 hops down, 3 backwards, 2 hops back
    assert simulate(build_schedule("1f1b", 3, 1), costs).makespan == 3 * 1 + 3 * 2 + 4 * 0.5


def test_measured_durations_can_come_as_a_mapping():
    sim = simulate(build_schedule("zb-h1", 2, 2), {"F": 2.0, "B": 1.0, "W": 3.0})
    assert {t.duration for row in sim.timeline.rows for t in row if t.action.kind.is_compute} == {1.0, 2.0, 3.0}


def test_per_action_durations_replay_a_measured_run():
    schedule = build_schedule("1f1b", 2, 2)
    slow = Action.parse("1B0")
    sim = simulate(schedule, Costs(per_action={slow: 10.0}))
    assert sim.makespan == simulate(schedule).makespan + 8.0  # 1B0 sits on the critical path


def move_after(row: list[Action], moved: str, anchor: str) -> None:
    action = row.pop(row.index(Action.parse(moved)))
    row.insert(row.index(Action.parse(anchor)) + 1, action)


def test_a_send_moved_behind_its_own_reply_deadlocks_with_a_step_rank_table():
    schedule = build_schedule("1f1b", 2, 1)
    move_after(schedule[0], "0SEND_F0", "0B0")  # rank 0 now waits for a gradient of an activation it never sent
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(schedule)
    text = str(info.value)
    assert "rank 0: 0RECV_B0 waits for 1SEND_B0" in text
    assert "rank 1: 1RECV_F0 waits for 0SEND_F0" in text
    assert "step | rank 0" in text and "[0RECV_B0]" in text and "[1RECV_F0]" in text


def test_sends_to_one_peer_out_of_order_are_caught():
    schedule = build_schedule("gpipe", 2, 2)
    move_after(schedule[0], "0SEND_F0", "0SEND_F1")
    with pytest.raises(ScheduleError, match="p2p order differs on 0->1"):
        simulate(schedule)


def test_a_missing_backward_is_named():
    schedule = build_schedule("1f1b", 2, 2)
    schedule[1] = [a for a in schedule[1] if str(a) not in ("1B1", "1SEND_B1")]
    with pytest.raises(ScheduleError, match="rank 1 never runs 1B1"):
        simulate(schedule)


def test_text_gantt_draws_blocks_to_scale_with_idle_gaps():
    text = render_text(simulate(build_schedule("1f1b", 2, 2)).timeline, width=18)
    assert text.splitlines() == [
        "rank  0 |F0F1    B0..  B1..",
        "rank  1 |  F0B0..F1B1..",
        "span 9, bubble 33.3%",
    ]


def test_png_gantt_is_written(tmp_path):
    path = tmp_path / "zb.png"
    render_png(simulate(build_schedule("zb-h1", 2, 3)).timeline, str(path))
    assert path.stat().st_size > 1000
