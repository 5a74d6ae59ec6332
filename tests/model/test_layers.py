"""Sharded layers against their dense single-device counterparts, weights sliced from the same full tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.layers import ColumnParallelLinear, ColumnPart, RowParallelLinear, VocabParallelEmbedding
from modelpar.parallel.regions import TensorParallelGroup
from modelpar.testing import current_groups, run_on_ranks
from tests.model.reference import layout_for, rel_err

B, S, H, F_OUT, VOCAB = 2, 8, 12, 16, 11  # VOCAB pads to 12 at tp=4
TOL = 1e-5


def _dense():
    g = torch.Generator().manual_seed(7)
    return {
        "x": torch.randn(B, S, H, generator=g),
        "w1": torch.randn(F_OUT, H, generator=g),
        "w2": torch.randn(H, F_OUT, generator=g),
        "emb": torch.randn(VOCAB, H, generator=g),
        "ids": torch.tensor([[0, 10, 5, 9, 1, 10, 3, 8], [2, 4, 6, 7, 0, 1, 9, 10]]),
    }


def _column_row(sp):
    tp = TensorParallelGroup.of(current_groups())
    d = _dense()
    column = ColumnParallelLinear(H, F_OUT, tp, sequence_parallel=sp).load_full(d["w1"])
    row = RowParallelLinear(F_OUT, H, tp, sequence_parallel=sp).load_full(d["w2"])
    x = (d["x"].chunk(tp.size, dim=1)[tp.rank] if sp else d["x"]).clone().requires_grad_()
    y = row(F.gelu(column(x)))
    (y * y).sum().backward()
    return y.detach(), x.grad, column.weight.grad, row.weight.grad


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_column_then_row_parallel_linear_equals_two_dense_layers(tp, sp):
    d = _dense()
    x, w1, w2 = (d[k].clone().requires_grad_() for k in ("x", "w1", "w2"))
    y = F.gelu(x @ w1.T) @ w2.T
    (y * y).sum().backward()
    results = run_on_ranks(4, _column_row, sp, layout=layout_for(tp))[:tp]
    if sp:  # each rank holds its sequence shard of the output and its share of the input gradient
        got_y = torch.cat([r[0] for r in results], dim=1)
        got_dx = torch.cat([r[1] for r in results], dim=1)
    else:
        got_y, got_dx = results[0][0], results[0][1]  # replicated: every rank holds all of it
        assert all(rel_err(r[1], got_dx) <= TOL for r in results)
    assert rel_err(got_y, y.detach()) <= TOL
    assert rel_err(got_dx, x.grad) <= TOL
    assert rel_err(torch.cat([r[2] for r in results], dim=0), w1.grad) <= TOL
    assert rel_err(torch.cat([r[3] for r in results], dim=1), w2.grad) <= TOL


def _embedding(sp):
    tp = TensorParallelGroup.of(current_groups())
    d = _dense()
    embedding = VocabParallelEmbedding(VOCAB, H, tp, sequence_parallel=sp).load_full(d["emb"])
    (shard,) = embedding.logical_shards().values()
    out = embedding(d["ids"])
    out.sum().backward()
    return out.detach(), shard.index, shard.grad, embedding.weight.grad[shard.local_shape[0] :]


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_vocab_parallel_embedding_equals_a_dense_lookup_and_padding_stays_inert(sp):
    tp = 4
    d = _dense()
    emb = d["emb"].clone().requires_grad_()
    want = F.embedding(d["ids"], emb)
    want.sum().backward()
    results = run_on_ranks(4, _embedding, sp, layout=layout_for(tp))
    got = torch.cat([r[0] for r in results], dim=1) if sp else results[0][0]
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    for _, index, grad, padding_grad in results:
        torch.testing.assert_close(grad, emb.grad[index], rtol=0, atol=0)
        assert padding_grad.numel() == 0 or not padding_grad.any()
    assert sum(r[3].shape[0] for r in results) == 1  # 11 ids padded to 12: one padded row on the last rank


def test_column_parallel_linear_of_an_int_refuses_a_split_that_does_not_divide():
    tp3 = TensorParallelGroup(group=object(), rank=0, size=3)  # the constructor never talks over the group
    with pytest.raises(ValueError, match="w1: 16 output features do not split over tp=3"):
        ColumnParallelLinear(H, F_OUT, tp3, name="w1")


def test_load_full_of_fused_parts_takes_each_full_weight_by_name():
    parts = [ColumnPart.even(name, rows, 0, 1) for name, rows in (("gate", 5), ("up", 7))]
    layer = ColumnParallelLinear(H, parts, TensorParallelGroup())
    gate, up = torch.randn(5, H), torch.randn(7, H)
    layer.load_full({"gate": gate, "up": up})
    assert torch.equal(layer.weight.detach(), torch.cat([gate, up]))
    with pytest.raises(ValueError, match=r"fuses \['gate', 'up'\]: pass \{name: full weight\}"):
        layer.load_full(torch.cat([gate, up]))


def test_load_full_refuses_a_weight_that_is_not_the_full_shape():
    with pytest.raises(ValueError, match=r"weight: got shape \(16, 12\), expected the full \(12, 16\)"):
        RowParallelLinear(F_OUT, H, TensorParallelGroup()).load_full(torch.zeros(F_OUT, H))  # [out, in] swapped
