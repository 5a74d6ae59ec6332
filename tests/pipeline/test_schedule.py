"""Schedule IR and generators: string form, one-line rejections, and every generated schedule is well formed."""

from __future__ import annotations

import pytest

from modelpar.pipeline.actions import (
    Action,
    ActionKind,
    ScheduleError,
    comm_batches,
    format_schedule,
    matching_action,
    parse_schedule,
)
from modelpar.pipeline.p2p_order import add_communication
from modelpar.pipeline.schedule import SCHEDULES, V_SCHEDULES, build_schedule, compute_order
from modelpar.pipeline.simulate import simulate

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W


def valid_configs() -> list[tuple[str, int, int, int]]:
    """(schedule, pp, m, vpp) for every pp in 2..5 and m in 1..9 that the schedule accepts."""
    out = []
    for name in SCHEDULES:
        vpp = 2 if name in ("interleaved", *V_SCHEDULES) else 1
        for pp in range(2, 6):
            for m in range(1, 10):
                if name != "interleaved" or m % pp == 0:
                    out.append((name, pp, m, vpp))
    return out


@pytest.mark.parametrize(
    "text, action",
    [
        ("1F0", Action(1, F, 0)),
        ("0B3c1", Action(0, B, 3, chunk=1)),
        ("2W1", Action(2, W, 1)),
        ("1RECV_F0", Action(1, ActionKind.RECV_F, 0)),
        ("0SEND_B12c3", Action(0, ActionKind.SEND_B, 12, chunk=3)),
    ],
)
def test_action_string_form_round_trips(text, action):
    assert str(action) == text
    assert Action.parse(text) == action


@pytest.mark.parametrize("text", ["F0", "1X0", "1F", "1F0c", "1SEND0"])
def test_unparsable_action_names_the_expected_form(text):
    with pytest.raises(ScheduleError, match="expected"):
        Action.parse(text)


def test_whole_schedule_round_trips_through_text():
    schedule = build_schedule("interleaved", 2, 4, vpp=2)
    assert parse_schedule(format_schedule(schedule)) == schedule


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("pipedream", 2, 4), "choose one of ['1f1b', 'dualpipev', 'gpipe', 'interleaved', 'zb-h1', 'zbv']"),
        (("interleaved", 4, 6, 2), "multiple of pp=4 (got m=6); try m in [4, 8]"),
        (("interleaved", 4, 2, 2), "multiple of pp=4 (got m=2); try m in [4]"),
        (("interleaved", 2, 4, 1), "needs vpp >= 2"),
        (("interleaved", 1, 4, 2), "needs pp >= 2"),
        (("1f1b", 2, 4, 2), "use vpp=1 or 'interleaved'"),
        (("zb-h1", 2, 4, 2), "use vpp=1 or 'interleaved'"),
        (("gpipe", 2, 0), "m=0 must be a positive integer"),
    ],
)
def test_impossible_requests_are_rejected_in_one_line(args, fragment):
    with pytest.raises(ScheduleError) as info:
        build_schedule(*args)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_fewer_micro_batches_than_stages_still_schedule(name):
    simulate(build_schedule(name, 4, 2))


def test_one_f_one_b_has_visible_warmup_steady_and_cooldown():
    compute = [[str(a) for a in row if a.kind.is_compute] for row in build_schedule("1f1b", 3, 4)]
    assert compute[0] == "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3".split()
    assert compute[2] == "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3".split()


def test_zero_bubble_defers_rank_r_weight_gradients_by_r():
    rank2 = [str(a) for a in build_schedule("zb-h1", 3, 4)[2] if a.kind.is_compute]
    assert rank2 == "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3".split()


@pytest.mark.parametrize("name, pp, m, vpp", valid_configs(), ids=str)
def test_generated_schedules_are_well_formed_and_cannot_deadlock(name, pp, m, vpp):
    schedule = build_schedule(name, pp, m, vpp)
    simulate(schedule)  # raises on a missing action, misordered p2p or a deadlock
    for r, row in enumerate(schedule):
        assert all(a.rank == r for a in row)
        for batch in comm_batches(row):
            if not batch[0].kind.is_compute:
                peers = [matching_action(a, pp, schedule.placement) for a in batch]
                assert all(peer in schedule[peer.rank] for peer in peers)


@pytest.mark.parametrize("name, pp, m, vpp", valid_configs()[::3], ids=str)
def test_the_compute_order_is_the_schedules_compute_actions_in_order(name, pp, m, vpp):
    """What the planner walks to count held activations and gradients, without placing the transfers."""
    want = [[a for a in row if a.kind.is_compute] for row in build_schedule(name, pp, m, vpp)]
    assert compute_order(name, pp, m, vpp) == want


def test_the_compute_order_refuses_what_the_schedule_refuses():
    with pytest.raises(ScheduleError, match="multiple of pp=4"):
        compute_order("interleaved", 4, 6, 2)


def test_add_communication_rejects_lists_that_already_communicate():
    with pytest.raises(ScheduleError, match="F, B and W actions only"):
        add_communication(build_schedule("1f1b", 2, 2), 2)
