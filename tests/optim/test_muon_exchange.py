"""Muon's owner exchange, every rank of a stage simulated in one process (a thread each, an all-to-all by
hand): each piece gets its matrix's Newton-Schulz result bit for bit, only the writers' values count, and no
rank's buffers are sized by the stage."""

import threading

import torch

from modelpar.model.layers.shard import ShardInfo
from modelpar.optim import muon_moves
from modelpar.optim.muon import MuonSettings, newton_schulz
from modelpar.optim.muon_exchange import MatrixTable, route
from modelpar.optim.muon_layout import Matrix, MuonLayout, build_muon_layout
from modelpar.optim.muon_moves import Take, runs_of

SETTINGS = MuonSettings(ns_dtype="fp32")
SHAPES = [(24, 16), (16, 40), (8, 8), (32, 12), (12, 12), (20, 6), (6, 30), (16, 16)]
# routed experts (batched per owner and shape): four w1 of one shape, four w2 of another
EXPERT_SHAPES = {"w1": (12, 20), "w2": (20, 12)}
EXPERTS = [(f"layers.1.mlp.experts.{e}.{w}.weight", shape) for w, shape in EXPERT_SHAPES.items() for e in range(4)]


class Stage:
    """``ranks`` threads exchanging through one mailbox: ``transport(rank)`` is that rank's all-to-all."""

    def __init__(self, ranks: int):
        self.ranks, self.barrier, self.box = ranks, threading.Barrier(ranks), [None] * ranks

    def transport(self, rank: int):
        def all_to_all(tensor, send, recv):
            self.box[rank] = tensor.split(send)
            self.barrier.wait()
            got = torch.cat([self.box[r][rank] for r in range(self.ranks)])
            assert [len(self.box[r][rank]) for r in range(self.ranks)] == recv
            self.barrier.wait()
            return got

        return all_to_all

    def run(self, fn):
        out, errors = [None] * self.ranks, []

        def one(rank):
            try:
                out[rank] = fn(rank, self.transport(rank))
            except Exception as e:  # noqa: BLE001 - surfaced below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


def _layout(ranks: int) -> MuonLayout:
    """The matrices of ``SHAPES`` and their owners as ``build_muon_layout`` assigns them (largest first)."""
    matrices, offset, loads = [], 0, [0] * ranks
    for name, shape in [(f"m{i}", shape) for i, shape in enumerate(SHAPES)] + EXPERTS:
        matrices.append(Matrix(name, shape, offset, 0, shape[0] * shape[1]))
        offset += shape[0] * shape[1]
    for i in sorted(range(len(matrices)), key=lambda i: -matrices[i].numel):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        loads[owner] += matrices[i].numel
        m = matrices[i]
        matrices[i] = Matrix(m.name, m.shape, m.offset, owner, m.flops)
    return MuonLayout(SETTINGS, matrices, {}, {}, 0, None, None, loads)


def _pieces(total: int, ranks: int, replicated: float, seed: int, shuffle: bool = True):
    """Each rank's pieces ``(positions, writes)``: every element written by one random rank, held besides by
    others with probability ``replicated`` (a ZeRO-0 replica, a tp-replicated row), cut into a few pieces;
    ``shuffle=False``: each rank holds one contiguous stretch (a ZeRO-1 segment), in order."""
    if not shuffle:
        bounds = [total * r // ranks for r in range(ranks + 1)]
        out = []
        for a, b in zip(bounds, bounds[1:], strict=False):
            positions = torch.arange(a, b)
            cut = (a + b) // 2 - a
            out.append([(positions[:cut], torch.ones(cut, dtype=torch.bool)), (positions[cut:], positions[cut:] >= 0)])
        return out
    g = torch.Generator().manual_seed(seed)
    writer = torch.randint(0, ranks, (total,), generator=g)
    out = []
    for r in range(ranks):
        held = (writer == r) | (torch.rand(total, generator=g) < replicated)
        positions = held.nonzero().squeeze(1)
        positions = positions[torch.randperm(len(positions), generator=g)]
        writes = writer[positions] == r
        cuts = sorted(torch.randint(0, len(positions) + 1, (3,), generator=g).tolist())
        bounds = [0, *cuts, len(positions)]
        out.append([(positions[a:b], writes[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


def _exchange(ranks: int, replicated: float, seed: int = 0, shuffle: bool = True):
    layout = _layout(ranks)
    total = layout.total
    truth = torch.randn(total, generator=torch.Generator().manual_seed(seed + 1))
    expected = torch.empty(total)
    for m in layout.matrices:
        expected[m.offset : m.offset + m.numel] = newton_schulz(
            truth[m.offset : m.offset + m.numel].view(m.shape), SETTINGS
        ).reshape(-1)
    pieces = _pieces(total, ranks, replicated, seed, shuffle)
    shapes = [m.shape for m in layout.matrices]

    def rank_step(rank, transport):
        r = route(layout.table, rank, shapes, pieces[rank], transport)
        # a value only its writer may send: the others' copies are poisoned, and must not reach the owner
        updates = [torch.where(w, truth[p], torch.nan) for p, w in pieces[rank]]
        outs = r.pieces(r.exchange(torch.cat(updates), layout._newton_schulz, transport))
        return r, outs

    return layout, pieces, expected, Stage(ranks).run(rank_step)


def test_each_piece_gets_its_whole_matrix_result_bit_for_bit(monkeypatch):
    monkeypatch.setattr(muon_moves, "MIN_RUN", 4)  # the test's matrices are small: compile their stretches too
    cases = ((1, 0.0, True), (4, 0.0, True), (4, 0.3, True), (3, 0.5, True), (1, 0.0, False), (2, 0.0, False))
    for ranks, replicated, shuffle in cases:
        layout, pieces, expected, results = _exchange(ranks, replicated, seed=ranks, shuffle=shuffle)
        if not shuffle:  # contiguous segments: every index map compiled to whole slices, not indices
            maps = [m for r, _ in results for m in (r.gather, r.place, r.serve, *r.spread)]
            assert all(m.index is None for m in maps), [m.numel for m in maps if m.index is not None]
        dense = sum(a * b for a, b in SHAPES)  # the experts follow: batched, held to the loop below
        for rank, (_, outs) in enumerate(results):
            for (positions, _), out in zip(pieces[rank], outs, strict=True):
                alone = positions < dense
                assert torch.equal(out[alone], expected[positions[alone]]), f"rank {rank} of {ranks}"
                torch.testing.assert_close(out[~alone], expected[positions[~alone]], rtol=1e-6, atol=1e-7)


def test_an_owners_experts_of_one_shape_are_one_batch():
    layout = _layout(2)
    for rank in range(2):
        r = route(layout.table, rank, [m.shape for m in layout.matrices], [], lambda t, s, _: t[: sum(s)])
        names = [[layout.matrices[i].name for i in indices] for _, _, indices in r.owned]
        expert_batches = [b for b in names if "experts" in b[0]]
        assert sorted(len(b) for b in expert_batches) == [2, 2]  # 4 w1 and 4 w2 over 2 owners
        assert all(len(b) == 1 for b in names if "experts" not in b[0])


def test_no_buffer_is_sized_by_the_stage():
    """sent <= the rank's pieces, received = owned = the matrices it owns, served = owned elements times the
    ranks holding each, returned <= its pieces: with 4 ranks and no replicas each holds about a quarter."""
    for replicated in (0.0, 0.3):
        layout, pieces, _, results = _exchange(4, replicated)
        holders = torch.zeros(layout.total, dtype=torch.long)
        for rank_pieces in pieces:
            for positions, _ in rank_pieces:
                holders[positions] += 1
        for rank, (r, _) in enumerate(results):
            sizes = r.buffer_numel()
            owned = [m for m in layout.matrices if m.owner == rank]
            owned_positions = torch.cat([torch.arange(m.offset, m.offset + m.numel) for m in owned])
            mine = sum(len(p) for p, _ in pieces[rank])
            assert sizes["pieces"] == mine
            assert sizes["sent"] == sum(int(w.sum()) for _, w in pieces[rank]) <= mine
            assert sizes["received"] == sizes["owned"] == sum(m.numel for m in owned)
            assert sizes["served"] == int(holders[owned_positions].sum())
            assert sizes["returned"] <= mine
            if replicated == 0.0:
                assert sizes["served"] == sizes["owned"]
                assert max(sizes["sent"], sizes["owned"], sizes["returned"]) < 0.5 * layout.total


def test_compiled_maps_move_what_the_index_does():
    """``Take``: ``src[index]`` and ``dst[index] = values`` by slices where the index runs, by index otherwise."""
    src = torch.randn(100)
    stretches = torch.cat([torch.arange(40, 70), torch.arange(0, 30), torch.arange(80, 100)])
    for index, min_run, by_slices in (
        (stretches, 8, True),
        (stretches, 64, False),
        (torch.arange(100), 8, True),
        (torch.randperm(100), 8, False),
        (torch.zeros(0, dtype=torch.long), 8, True),
    ):
        take = Take.of(index, min_run)
        assert (take.index is None) == by_slices
        assert torch.equal(take(src), src[index])
        parts = torch.cat([v for _, v in take.segments(src)]) if len(index) else src[:0]
        assert torch.equal(parts, src[index])
        assert [at for at, _ in take.segments(src)][:1] in ([0], [])
        dst, want = torch.zeros(100), torch.zeros(100)
        take.put(dst, src[: len(index)])
        want[index] = src[: len(index)]
        assert torch.equal(dst, want)
    assert runs_of(stretches) == [(40, 30), (0, 30), (80, 20)]
    assert Take.of(torch.arange(100), 8).is_identity(100) and not Take.of(stretches, 8).is_identity(100)


def test_zero0_replicas_share_the_writing_evenly():
    """Under ZeRO-0 the dp x cp replicas of a parameter each write an even stretch of its elements (each element
    by exactly one of them), so no replica sends more than its share; a tp-replicated row's non-primary holder
    writes none."""
    fused = torch.nn.Parameter(torch.zeros(16, 6))
    out = torch.nn.Parameter(torch.zeros(6, 10))
    shards = {
        "l.q_proj.weight": ShardInfo(fused, slice(0, 8), (8, 6)),
        "l.k_proj.weight": ShardInfo(fused, slice(8, 16), (8, 6), replicated_over_tp=True, primary=False),
        "l.o_proj.weight": ShardInfo(out, slice(0, 6), (6, 10)),
    }
    writes = []
    for index in range(3):
        replicas = {id(fused): (index, 3), id(out): (index, 3)}
        layout = build_muon_layout(SETTINGS, [fused, out], shards, stage_group=None, replicas=replicas)
        writes.append([layout.writes[id(fused)], layout.writes[id(out)]])
    for p, (numel, written) in enumerate(((16 * 6, 8 * 6), (60, 60))):
        mine = torch.stack([w[p].reshape(-1) for w in writes]).long()
        assert [int(m.sum()) for m in mine] == [written // 3] * 3
        assert bool((mine.sum(0) <= 1).all()) and int(mine.sum()) == written  # one writer each
        assert mine.shape[1] == numel
    assert not bool(torch.stack([w[0][8:] for w in writes]).any())  # k_proj's rows: another tp rank writes them


def test_matrix_table_places_positions_in_the_owners_buffer():
    layout = _layout(3)
    table: MatrixTable = layout.table
    for rank in range(3):
        mine, base = table.owned(rank)
        for i, b in zip(mine.tolist(), base.tolist(), strict=True):
            m = layout.matrices[i]
            positions = torch.arange(m.offset, m.offset + m.numel)
            assert torch.equal(table.local(rank, positions), torch.arange(b, b + m.numel))
            assert bool((table.owner_of(positions) == rank).all())
