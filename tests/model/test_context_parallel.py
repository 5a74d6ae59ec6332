"""Context-parallel attention computes the attention of the whole sequence: outputs and dq/dk/dv on every cp
rank's chunks equal the single-device attention's, for the ring and the all-gather, with and without
document masking."""

import pytest
import torch
import torch.nn.functional as F

from modelpar.parallel.context import (
    ContextParallelGroup,
    context_parallel_attention,
    document_ids,
    local_positions,
    merge_from_context,
    split_for_context,
)
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import current_groups, run_on_ranks


def test_balanced_split_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    x = torch.arange(24).view(1, 24)
    parts = [split_for_context(x, ContextParallelGroup(size=1)) for _ in range(1)]
    assert torch.equal(parts[0], x)
    parts = [x.index_select(1, local_positions(24, 3, r)) for r in range(3)]
    assert torch.equal(merge_from_context(parts), x)
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
        local_positions(10, 2, 0)


def test_each_eos_opens_a_new_document():
    tokens = torch.tensor([[5, 0, 7, 7, 0, 0, 3], [1, 2, 3, 4, 5, 6, 0]])
    assert document_ids(tokens, eos_id=0).tolist() == [[0, 1, 1, 1, 2, 3, 3], [0, 0, 0, 0, 0, 0, 1]]


def reference_attention(q, k, v, documents):
    """Full-sequence attention, the single-device way: SDPA, causal (and same-document) mask."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    s = q.shape[1]
    keep = torch.ones(s, s, dtype=torch.bool).tril()
    if documents is not None:
        keep = keep & (documents[:, None, :, None] == documents[:, None, None, :])
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _inputs(seq, heads, kv_heads, with_documents):
    gen = torch.Generator().manual_seed(3)
    b, d = 2, 8
    q = torch.randn(b, seq, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, seq, kv_heads, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, seq, kv_heads, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, seq, heads, d, generator=gen, dtype=torch.float64)
    documents = None
    if with_documents:  # documents of uneven lengths, one crossing every chunk boundary, one within a chunk
        tokens = torch.randint(1, 9, (b, seq), generator=gen)
        tokens[0, [2, 3, seq // 2 + 1]] = 0
        tokens[1, [seq - 3]] = 0
        documents = document_ids(tokens, eos_id=0)
    return q, k, v, dout, documents


def cp_matches_full_attention(comm, seq, heads, kv_heads, with_documents, a2a=0):
    from modelpar.parallel.collectives import record_comm

    groups = current_groups()
    cp = ContextParallelGroup.of(groups, comm, a2a)
    q, k, v, dout, documents = _inputs(seq, heads, kv_heads, with_documents)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*full, documents)
    ref.backward(dout)
    local = [split_for_context(t, cp).requires_grad_(True) for t in (q, k, v)]
    with record_comm() as log:
        out = context_parallel_attention(*local, cp, documents)
        out.backward(split_for_context(dout, cp))
    torch.testing.assert_close(out, split_for_context(ref, cp), rtol=1e-10, atol=1e-10)
    for name, mine, whole in zip("qkv", local, full, strict=True):
        torch.testing.assert_close(mine.grad, split_for_context(whole.grad, cp), rtol=1e-10, atol=1e-10, msg=name)
    if comm in ("alltoall", "hybrid"):
        return log.count("all_to_all"), log.total_bytes("all_to_all"), log.count("send_recv")
    return log.count("send_recv"), log.total_bytes("send_recv"), log.count("all_gather"), log.count("reduce_scatter")


@pytest.mark.parametrize("comm", ["ring", "allgather"])
@pytest.mark.parametrize("with_documents", [False, True], ids=["causal", "documents"])
def test_cp2_attention_matches_full_attention(comm, with_documents):
    results = run_on_ranks(2, cp_matches_full_attention, comm, 12, 4, 2, with_documents, layout=ParallelLayout(cp=2))
    sends, sent_bytes, gathers, scatters = results[0]
    if comm == "ring":
        # forward: K/V (kv heads only) once; backward: K/V once and dK/dV twice (onwards, then home)
        kv_bytes = 2 * 2 * 2 * 6 * 8 * 8  # [k|v, b, kv heads, s/cp, d] in fp64
        assert (sends, gathers, scatters) == (4, 0, 0)
        assert sent_bytes == 4 * kv_bytes
    else:  # K/V gathered forward and again backward (not kept), dK/dV reduce-scattered
        assert (sends, gathers, scatters) == (0, 2, 1)


@pytest.mark.parametrize("comm", ["ring", "allgather"])
def test_cp4_attention_matches_full_attention_with_documents(comm):
    run_on_ranks(4, cp_matches_full_attention, comm, 16, 2, 1, True, layout=ParallelLayout(cp=4))


ULYSSES = [  # (cp, comm, a2a, heads, kv heads): kv heads split, repeated (kv < cp), a hybrid 2 x 2 ring
    (2, "alltoall", 0, 4, 2),
    (4, "alltoall", 0, 4, 2),
    (4, "alltoall", 0, 4, 1),
    (4, "hybrid", 2, 2, 1),
    (4, "hybrid", 2, 4, 2),
]


@pytest.mark.parametrize(
    "cp, comm, a2a, heads, kv_heads", ULYSSES, ids=[f"cp{c}-{m}{a or ''}-h{h}kv{k}" for c, m, a, h, k in ULYSSES]
)
def test_head_exchange_attention_matches_full_attention_with_documents(cp, comm, a2a, heads, kv_heads):
    """Outputs and dq/dk/dv equal the full attention's (fp64, 1e-10) with q/k/v exchanged to a head shard: GQA
    with kv heads split or repeated, hybrid's ring across all-to-all groups; documents cross every chunk."""
    seq, b, d = 16, 2, 8
    results = run_on_ranks(
        cp, cp_matches_full_attention, comm, seq, heads, kv_heads, True, a2a, layout=ParallelLayout(cp=cp)
    )
    n = cp if comm == "alltoall" else a2a
    repeats = n // __import__("math").gcd(kv_heads, n)
    local = b * (seq // cp) * d * 8  # one head of this rank's tokens, fp64 bytes
    # forward: q, k, v out (one all-to-all), o back; backward the same two, each the whole local tensor
    expected = 2 * local * (2 * heads + 2 * kv_heads * repeats)
    for count, moved, sends in results:
        assert (count, moved) == (4, expected)
        assert sends == (0 if n == cp else 4)  # hybrid 2 x 2: the ring of 2 as at cp2, on the exchanged heads


def ring_block_sizes():
    """(rows, cols) of every block the ring computes on this rank, forward and backward."""
    import modelpar.parallel.context as context

    seen = []
    forward, backward = context.block_attention_forward, context.block_attention_backward

    def counting_forward(q, k, *args):
        seen.append(("F", q.shape[2], k.shape[2]))
        return forward(q, k, *args)

    def counting_backward(dout, q, k, *args):
        seen.append(("B", q.shape[2], k.shape[2]))
        return backward(dout, q, k, *args)

    context.block_attention_forward, context.block_attention_backward = counting_forward, counting_backward
    try:
        cp_matches_full_attention("ring", 16, 2, 2, False)
    finally:
        context.block_attention_forward, context.block_attention_backward = forward, backward
    return seen


def test_ring_skips_the_masked_half_of_every_off_diagonal_block():
    for rank, seen in enumerate(run_on_ranks(4, ring_block_sizes, layout=ParallelLayout(cp=4))):
        local = 4
        # one causal diagonal block, then three half blocks (rows x cols = L*L/2), forward and backward
        assert seen[0] == ("F", local, local) and seen[4] == ("B", local, local), rank
        assert all(r * c == local * local // 2 for _, r, c in seen[1:4] + seen[5:]), (rank, seen)


def _loss_and_grads(comm, with_documents):
    """The tiny model's loss and every logical tensor's gradient on one batch: on the single device when called
    outside emulated ranks' layout, else at cp (the cp ranks' gradients averaged, as dp x cp reduction does)."""
    import torch.distributed as dist

    from modelpar.model.config import ModelConfig
    from modelpar.model.transformer import build_model

    config = ModelConfig(vocab_size=37, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=32)
    groups = current_groups() if dist.is_initialized() else None
    model = build_model(config, groups, seed=3, cp_comm=comm)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(1, 37, (2, 17), generator=gen)
    tokens[0, [4, 5, 11]] = 0
    tokens[1, [9]] = 0
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if with_documents:
        documents = document_ids(inputs, eos_id=0)
        model.documents.source = lambda: documents
    loss = model.loss(model(split_for_context(inputs, model.cp)), split_for_context(targets, model.cp))
    loss.backward()
    grads = {name: shard.grad.clone() for name, shard in model.logical_shards().items()}
    if model.cp.size > 1:
        for tensor in (loss.detach(), *grads.values()):
            dist.all_reduce(tensor, group=model.cp.group)
            tensor /= model.cp.size
    return loss.item(), grads


@pytest.mark.parametrize(
    "comm, with_documents",
    [("ring", False), ("ring", True), ("allgather", True)],
    ids=["ring", "ring-docs", "allgather-docs"],
)
def test_model_at_cp2_gives_the_single_device_loss_and_gradients(comm, with_documents):
    """Global RoPE positions, the split of tokens and targets, and (document-)causal attention across the split:
    the cp ranks' mean loss and mean gradients are the single-device model's on the whole batch."""
    want_loss, want = _loss_and_grads(comm, with_documents)
    for loss, grads in run_on_ranks(2, _loss_and_grads, comm, with_documents, layout=ParallelLayout(cp=2)):
        assert loss == pytest.approx(want_loss, rel=1e-6)
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
