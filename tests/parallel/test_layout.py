"""ParallelLayout: coordinates, groups and validation, with and without emulated ranks."""

import itertools

import pytest
import torch
import torch.distributed as dist

from modelpar import LayoutError, ParallelLayout
from modelpar.testing import current_groups, run_on_ranks


def factorisations(n: int) -> list[ParallelLayout]:
    return [
        ParallelLayout(tp=tp, pp=pp, dp=n // (tp * pp))
        for tp, pp in itertools.product(range(1, n + 1), repeat=2)
        if n % (tp * pp) == 0
    ]


LAYOUTS_8 = factorisations(8)


def test_eight_ranks_have_ten_factorisations():
    assert len(LAYOUTS_8) == 10


@pytest.mark.parametrize("layout", LAYOUTS_8, ids=str)
def test_coords_round_trip_with_tp_fastest(layout):
    seen = set()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank(c.dp, c.pp, c.tp) == rank
        assert rank == (c.dp * layout.pp + c.pp) * layout.tp + c.tp
        seen.add((c.dp, c.pp, c.tp))
    assert len(seen) == layout.world_size
    assert layout.tp_ranks(0) == list(range(layout.tp))  # neighbours share a tp group


@pytest.mark.parametrize("layout", LAYOUTS_8, ids=str)
def test_groups_partition_the_world(layout):
    for groups, size in (
        (layout.all_tp_groups(), layout.tp),
        (layout.all_pp_groups(), layout.pp),
        (layout.all_dp_groups(), layout.dp),
    ):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(8))
        assert all(len(g) == size for g in groups)


def test_embedding_group_is_first_and_last_stage():
    layout = ParallelLayout(tp=2, pp=4)
    assert layout.embedding_ranks(3) == [1, 7]
    assert ParallelLayout(pp=1, dp=2).embedding_ranks(1) == [1]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"tp": 0}, "tp=0 must be >= 1"),
        ({"tp": 1.5}, "tp=1.5 must be a positive integer"),
        ({"pp": 1, "vpp": 2}, "vpp=2 needs pipeline parallelism"),
    ],
)
def test_impossible_layout_is_one_clear_line(kwargs, needle):
    with pytest.raises(LayoutError, match=needle) as info:
        ParallelLayout(**kwargs)
    assert "\n" not in str(info.value)


def test_model_checks_suggest_a_fix():
    layout = ParallelLayout(tp=3)
    with pytest.raises(LayoutError, match=r"tp=3 does not divide heads=8; try tp in \[1, 2, 4, 8\]"):
        layout.check_model(layers=4, heads=8, kv_heads=8, ffn_hidden=96)
    with pytest.raises(LayoutError, match="pp\\*vpp=8 exceeds the 4 layers"):
        ParallelLayout(pp=4, vpp=2).check_model(layers=4, heads=8, kv_heads=8, ffn_hidden=96)
    with pytest.raises(LayoutError, match="needs 4 ranks but the world has 8; change dp to 2"):
        ParallelLayout(tp=2, pp=2).check_world_size(8)


def _group_sums():
    """Every rank contributes its rank id; each group's all-reduce must give the sum of its members."""
    g = current_groups()
    out = {}
    for kind in ("tp", "pp", "dp", "embedding"):
        if getattr(g, f"{kind}_group") is None:
            continue
        t = torch.tensor([float(g.rank)])
        dist.all_reduce(t, group=getattr(g, f"{kind}_group"))
        out[kind] = (t.item(), list(getattr(g, f"{kind}_ranks")))
    return g.rank, out


@pytest.mark.parametrize("layout", LAYOUTS_8, ids=str)
def test_all_reduce_in_every_group_sums_its_members(layout):
    results = run_on_ranks(8, _group_sums, layout=layout)
    for rank, (reported_rank, sums) in enumerate(results):
        assert reported_rank == rank
        assert sums["tp"] == (sum(layout.tp_ranks(rank)), layout.tp_ranks(rank))
        assert sums["pp"] == (sum(layout.pp_ranks(rank)), layout.pp_ranks(rank))
        assert sums["dp"] == (sum(layout.dp_ranks(rank)), layout.dp_ranks(rank))
        emb = layout.embedding_ranks(rank)
        if rank in emb:
            assert sums["embedding"] == (sum(emb), emb)
        else:
            assert "embedding" not in sums


@pytest.mark.ranks(4, layout=ParallelLayout(tp=2, pp=2))
def test_marker_runs_the_body_on_each_rank():
    g = current_groups()
    assert dist.get_world_size() == 4
    assert (g.tp_rank, g.pp_rank) == (g.rank % 2, g.rank // 2)
    assert g.is_first_stage == (g.rank < 2) and g.is_last_stage == (g.rank >= 2)
