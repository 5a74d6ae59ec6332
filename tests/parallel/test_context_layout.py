"""The cp dimension of the layout: rank order (tp innermost, then cp, then pp, dp), its groups, and recipes
that cannot split their sequences rejected in one line before any rank starts."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from modelpar import ParallelLayout
from modelpar.testing import current_groups, run_on_ranks
from modelpar.training.config import DataConfig, ModelConfig, ParallelConfig, RecipeError, TrainConfig, validate

CP_LAYOUTS = [
    ParallelLayout(tp=tp, cp=cp, pp=pp, dp=8 // (tp * cp * pp))
    for tp, cp, pp in itertools.product((1, 2), (2, 4), (1, 2))
    if 8 % (tp * cp * pp) == 0
]


@pytest.mark.parametrize("layout", CP_LAYOUTS, ids=str)
def test_tp_is_innermost_then_cp_then_pp_then_dp(layout):
    seen = set()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert rank == ((c.dp * layout.pp + c.pp) * layout.cp + c.cp) * layout.tp + c.tp
        assert layout.rank(c.dp, c.pp, c.tp, c.cp) == rank
        seen.add((c.dp, c.pp, c.cp, c.tp))
        assert len(layout.dp_cp_ranks(rank)) == layout.dp * layout.cp
        assert rank in layout.cp_ranks(rank) and rank in layout.dp_cp_ranks(rank)
    assert len(seen) == layout.world_size
    assert layout.tp_ranks(0) == list(range(layout.tp))  # tp neighbours
    assert layout.cp_ranks(0) == list(range(0, layout.tp * layout.cp, layout.tp))
    for groups in (layout.all_cp_groups(), layout.all_dp_cp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_cp1_keeps_the_tp_pp_dp_rank_mapping():
    for tp, pp, dp in ((2, 2, 2), (1, 4, 2), (4, 1, 2)):
        layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
        for rank in range(8):
            c = layout.coords(rank)
            assert (c.cp, rank) == (0, (c.dp * pp + c.pp) * tp + c.tp)
        assert str(layout) == f"tp{tp}-pp{pp}-dp{dp}"
    assert str(ParallelLayout(tp=2, cp=2, dp=2)) == "tp2-cp2-pp1-dp2"


def _cp_group_sums():
    g = current_groups()
    out = {}
    for kind in ("cp", "dp_cp"):
        t = torch.tensor([float(g.rank)])
        dist.all_reduce(t, group=getattr(g, f"{kind}_group"))
        out[kind] = (t.item(), list(getattr(g, f"{kind}_ranks")))
    return g.cp_rank, out


def test_cp_and_dp_cp_groups_reduce_over_their_members():
    layout = ParallelLayout(tp=2, cp=2, dp=2)
    for rank, (cp_rank, sums) in enumerate(run_on_ranks(8, _cp_group_sums, layout=layout)):
        assert cp_rank == layout.coords(rank).cp
        assert sums["cp"] == (sum(layout.cp_ranks(rank)), layout.cp_ranks(rank))
        assert sums["dp_cp"] == (sum(layout.dp_cp_ranks(rank)), layout.dp_cp_ranks(rank))


def _recipe(**changes) -> TrainConfig:
    cfg = TrainConfig(
        model=ModelConfig(max_seq_len=64),
        parallel=ParallelConfig(cp=2),
        data=DataConfig(seq_len=16, global_batch=4),
    )
    for group, values in changes.items():
        setattr(cfg, group, dataclasses.replace(getattr(cfg, group), **values))
    return cfg


@pytest.mark.parametrize(
    "changes, needle",
    [
        (
            dict(data=dict(seq_len=18)),
            "parallel.cp=2 needs data.seq_len=18 divisible by 2*cp=4 (each cp rank holds 2 of 2*cp chunks); "
            "try cp in [1, 3, 9] or data.seq_len=20",
        ),
        (
            dict(parallel=dict(cp=2, tp=4, sp=True), data=dict(seq_len=20)),
            "parallel.sp=true needs data.seq_len=20 / cp=2 = 10 tokens per cp rank divisible by parallel.tp=4",
        ),
        (dict(parallel=dict(cp_comm="ulysses")), "parallel.cp_comm='ulysses' must be one of ring, allgather, alltoall"),
        (
            dict(parallel=dict(cp=4, cp_comm="alltoall", tp=2), model=dict(heads=4, kv_heads=2)),
            "parallel.cp_comm=alltoall splits the 2 query heads per tp rank (model.heads=4 / tp=2) over an all-to-all "
            "of 4 cp ranks, which does not divide them; use parallel.cp_comm=hybrid with parallel.cp_a2a in [1, 2]",
        ),
        (
            dict(parallel=dict(cp=4, cp_comm="hybrid", cp_a2a=3)),
            "parallel.cp_comm=hybrid needs parallel.cp_a2a (the all-to-all group size) dividing parallel.cp=4, got 3; "
            "try cp_a2a in [1, 2, 4]",
        ),
        (dict(parallel=dict(cp_comm="hybrid")), "parallel.cp_comm=hybrid needs parallel.cp_a2a"),
        (dict(parallel=dict(cp_a2a=2)), "parallel.cp_a2a=2 applies only to parallel.cp_comm=hybrid"),
        (dict(model=dict(compile=True)), "parallel.cp=2 with model.compile=true is not supported"),
        (dict(data=dict(eos_id=300)), "data.eos_id=300 is not a token id of model.vocab_size=256"),
        (dict(parallel=dict(cp=0)), "cp=0 must be >= 1"),
    ],
)
def test_a_recipe_that_cannot_split_its_sequences_is_one_line(changes, needle):
    from modelpar.parallel.layout import LayoutError

    with pytest.raises((RecipeError, LayoutError)) as caught:
        validate(_recipe(**changes))
    assert str(caught.value).startswith(needle), str(caught.value)
    assert "\n" not in str(caught.value)
    validate(_recipe())


def test_document_mask_without_an_eos_id_is_refused_before_ranks_start(tmp_path):
    from modelpar.training.build import resolve_eos_id
    from modelpar.training.preflight import preflight

    path = tmp_path / "plain.npy"
    np.save(path, np.zeros(400, dtype=np.uint16))  # no sidecar: no tokenizer, so no EOS
    cfg = _recipe(data=dict(path=str(path), document_mask=True))
    with pytest.raises(RecipeError, match=r"^data.document_mask=true needs an EOS id, and .* set data.eos_id"):
        preflight(cfg)
    assert resolve_eos_id(_recipe(data=dict(document_mask=True, eos_id=7)), str(path)) == 7
    assert resolve_eos_id(_recipe(), str(path)) is None


def test_a_world_that_cp_does_not_fit_is_named():
    from modelpar.parallel.layout import LayoutError

    with pytest.raises(LayoutError, match=r"needs 8 ranks but the world has 6; tp\*cp\*pp=4 must divide"):
        ParallelLayout(tp=2, cp=2, dp=2).check_world_size(6)
