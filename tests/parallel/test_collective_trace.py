"""torch's flight recorder of collectives: dumped per rank in torch's format, read back to name the first
collective the ranks of a group disagree on."""

from __future__ import annotations

import json

from modelpar.parallel import collective_trace
from modelpar.parallel.collective_trace import first_disagreement, lagging_ranks
from modelpar.training.flight import hang_report


def _entry(group: str, seq: int, op: str = "all_reduce", sizes=((4,),), t: int = 0) -> dict:
    return {
        "pg_id": 7,
        "process_group": (group, "tp"),
        "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}",
        "input_sizes": [list(s) for s in sizes],
        "input_dtypes": ["Float"],
        "time_created_ns": t,
        "is_p2p": False,
    }


def _trace(rank: int, ranks: list[int], entries: list[dict]) -> dict:
    last = max((e["collective_seq_id"] for e in entries), default=-1)
    return {
        "rank": rank,
        "pg_config": {"1": {"name": "1", "desc": "tp", "ranks": json.dumps(ranks)}},
        "pg_status": {"7": {"last_enqueued_collective": last}},  # keyed by torch's internal id, not the name
        "entries": entries,
    }


def test_a_collective_one_rank_never_issued_is_named_with_who_did():
    both = [_entry("1", s, t=s) for s in (1, 2)]
    traces = [
        _trace(0, [0, 1, 2], [*both, _entry("1", 3, sizes=((2, 8),), t=3)]),
        _trace(1, [0, 1, 2], both),
        _trace(2, [0, 1, 2], [*both, _entry("1", 3, sizes=((2, 8),), t=4)]),
    ]
    assert first_disagreement(traces) == (
        "group tp (ranks 0, 1, 2): collective #3 all_reduce of [[2, 8]] was issued by ranks 0, 2, not by rank 1 "
        "(last issued #2)"
    )
    assert lagging_ranks(traces) == [1]


def test_the_recorder_breaks_a_tie_between_two_ranks_computing_since_the_same_moment():
    # rank 0's last snapshot predates its wait in the all-reduce rank 1 never joined: both look busy alike
    snaps = [
        {"rank": r, "step": 1, "now": 10.0, "current": {"action": "0F0", "since": 2.0, "waiting": False}}
        for r in (0, 1)
    ]
    assert hang_report(snaps).startswith("rank 0 stuck in 0F0")
    assert hang_report(snaps, lagging=[1]).startswith("rank 1 stuck in 0F0 at step 1 (no progress for 8 s)")
    snaps[1]["current"]["waiting"] = True  # a rank seen waiting stays behind one computing, recorder or not
    assert hang_report(snaps, lagging=[1]).startswith("rank 0 stuck")


def test_different_operations_at_the_same_place_are_named_and_the_earliest_disagreement_wins():
    traces = [
        _trace(0, [0, 1], [_entry("1", 1, t=1), _entry("1", 2, "broadcast", t=2), _entry("1", 3, t=5)]),
        _trace(1, [0, 1], [_entry("1", 1, t=1), _entry("1", 2, "all_reduce", sizes=((8,),), t=2)]),
    ]
    assert first_disagreement(traces) == (
        "group tp (ranks 0, 1): collective #2 differs: rank 0 broadcast of [[4]] Float; "
        "rank 1 all_reduce of [[8]] Float"
    )


def test_ranks_that_agree_yield_no_disagreement():
    same = [_entry("1", s, t=s) for s in (1, 2, 3)]
    assert first_disagreement([_trace(0, [0, 1], same), _trace(1, [0, 1], same)]) is None
    assert lagging_ranks([_trace(0, [0, 1], same), _trace(1, [0, 1], same)]) == []


def _dump_with_one_extra_collective() -> dict:
    """On a rank: rank 0 issues one all-reduce on a fresh group that rank 1 issues only after both dumped."""
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1], group_desc="extra")
    x = torch.ones(3, 5)
    dist.all_reduce(x, group=group)
    work = dist.all_reduce(x, group=group, async_op=True) if dist.get_rank() == 0 else None
    trace = collective_trace.dump()
    dist.barrier()  # both dumped: now rank 1 matches rank 0's extra all-reduce
    if work is None:
        dist.all_reduce(x, group=group)
    else:
        work.wait()
    dist.barrier()
    dist.destroy_process_group(group)
    return trace


def test_real_dumps_of_two_gloo_ranks_name_the_collective_only_one_issued():
    from modelpar.testing import run_on_ranks

    traces = run_on_ranks(2, _dump_with_one_extra_collective)
    assert [t["rank"] for t in traces] == [0, 1]
    line = first_disagreement(traces)
    assert line is not None and line.startswith("group extra (ranks 0, 1): collective #2 all_reduce of [[3, 5]]")
    assert line.endswith("was issued by rank 0, not by rank 1 (last issued #1)")


def test_dumps_round_trip_through_the_directory(tmp_path):
    import pickle

    traces = [_trace(r, [0, 1], [_entry("1", 1)]) for r in (1, 0)]
    for t in traces:
        (tmp_path / f"rank_{t['rank']}").write_bytes(pickle.dumps(t))
    (tmp_path / "rank_2.tmp").write_bytes(b"half a file")
    assert [t["rank"] for t in collective_trace.read(tmp_path)] == [0, 1]
    report = collective_trace.trace_report(tmp_path, ranks=3)
    assert report.startswith("torch flight recorder (no dump from rank 2): every group's ranks issued the same")


def test_a_rank_that_issued_nothing_on_the_group_is_behind_unless_its_ring_is_full():
    ahead = _trace(0, [0, 1], [_entry("1", 1, t=1)])
    assert first_disagreement([ahead, _trace(1, [0, 1], [])]).endswith(
        "issued by rank 0, not by rank 1 (last issued #0)"
    )
    full = dict(_trace(1, [0, 1], [_entry("2", s) for s in range(1, 4)]), ring_size=3)  # only another group's
    assert first_disagreement([ahead, full]) is None
