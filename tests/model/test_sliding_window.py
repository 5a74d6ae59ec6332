"""Sliding-window attention in the model: a window (on some layers only: local and global layers) changes the
single-device function, and tp2 and cp2 (ring, all-gather, all-to-all; torch and the Triton kernel; with and
without documents) give its loss and gradients; the ring computes only the chunk pairs the window reaches."""

import pytest
import torch
import torch.nn.functional as F

from modelpar.model.config import ModelConfig, ModelConfigError
from modelpar.parallel.context import document_ids, local_positions, split_for_context
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import current_groups, run_on_ranks

# layer 0 local (window 5 of 16 tokens), layer 1 global
CONFIG = ModelConfig(
    vocab_size=37, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=32, sliding_window=5,
    window_layers=[0],
)  # fmt: skip
CP_CASES = [  # (cp_comm, kernels, documents)
    ("ring", "torch", False),
    ("ring", "torch", True),
    ("allgather", "torch", True),
    ("alltoall", "torch", False),
    ("ring", "triton", True),
]


def _tokens():
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(1, 37, (2, 17), generator=gen)
    tokens[0, [4, 11]] = 0
    tokens[1, [9]] = 0
    return tokens[:, :-1], tokens[:, 1:]


def _loss_and_grads(config, comm="ring", backend="torch", with_documents=False):
    """Loss and every logical tensor's gradient on one batch; at cp the cp ranks' mean (as the dp x cp
    reduction takes it)."""
    from dataclasses import replace

    import torch.distributed as dist

    from modelpar.model.transformer import build_model

    groups = current_groups() if dist.is_initialized() else None
    model = build_model(replace(config, kernels=backend), groups, seed=3, cp_comm=comm)
    inputs, targets = _tokens()
    if with_documents:
        documents = document_ids(inputs, eos_id=0)
        model.documents.source = lambda: documents
    loss = model.loss(model(split_for_context(inputs, model.cp)), split_for_context(targets, model.cp))
    loss.backward()
    grads = {name: shard.grad.clone() for name, shard in model.logical_shards().items()}
    loss = loss.detach()
    if model.cp.size > 1:
        for tensor in (loss, *grads.values()):
            dist.all_reduce(tensor, group=model.cp.group)
            tensor /= model.cp.size
    return loss.item(), grads


def _cases(cases):
    return [_loss_and_grads(CONFIG, *case) for case in cases]


def _assert_same(got, want, label):
    loss, grads = got
    assert loss == pytest.approx(want[0], rel=1e-6), label
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[1][name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{label} {n}: {m}")


def test_window_changes_the_single_device_loss():
    windowed, full = _loss_and_grads(CONFIG), _loss_and_grads(ModelConfig(**{**CONFIG.__dict__, "sliding_window": 0,
                                                                            "window_layers": []}))  # fmt: skip
    assert windowed[0] != pytest.approx(full[0], rel=1e-4)


def test_window_config_is_checked_in_one_line():
    with pytest.raises(ModelConfigError, match="model.sliding_window=-1 must be >= 0"):
        ModelConfig(sliding_window=-1).check()
    with pytest.raises(ModelConfigError, match=r"model.window_layers=\[2\] must be distinct layer ids in 0..1"):
        ModelConfig(sliding_window=4, window_layers=[2]).check()
    with pytest.raises(ModelConfigError, match="needs model.sliding_window > 0"):
        ModelConfig(window_layers=[0]).check()
    assert [CONFIG.window(i) for i in range(2)] == [5, 0]
    assert ModelConfig(sliding_window=4).window(1) == 4  # no window_layers: every layer
    assert "sliding_window" not in CONFIG.identity()  # what the weights mean does not change


def test_cp2_gives_the_single_device_loss_and_gradients():
    want = {docs: _loss_and_grads(CONFIG, "ring", "torch", docs) for docs in (False, True)}
    for rank_results in run_on_ranks(2, _cases, CP_CASES, layout=ParallelLayout(cp=2)):
        for case, got in zip(CP_CASES, rank_results, strict=True):
            _assert_same(got, want[case[2]], case)


def _ring_pairs(window):
    """On a cp4 rank: the ring's computed blocks (forward calls of the block kernel) and the chunk pairs it chose,
    for a window of ``window`` over 32 tokens (chunks of 4)."""
    from modelpar.parallel import context
    from modelpar.parallel.context import ContextParallelGroup, context_parallel_attention

    cp = ContextParallelGroup.of(current_groups(), "ring")
    calls, chosen = [], []
    forward, choose = context.block_attention_forward, context._blocks_and_masks

    def counting_forward(q, k, v, mask, backend):
        calls.append((q.shape[2], k.shape[2]))
        return forward(q, k, v, mask, backend)

    def recording_choose(rank, source, *args):
        blocks = choose(rank, source, *args)
        chosen.extend((source, blk.rows.start, blk.cols.start) for blk, _ in blocks)
        return blocks

    context.block_attention_forward, context._blocks_and_masks = counting_forward, recording_choose
    try:
        gen = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(1, 32, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        keep = torch.tensor([[0 <= i - j < window for j in range(32)] for i in range(32)])
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in whole), attn_mask=keep).transpose(1, 2)
        local = [split_for_context(t, cp) for t in (q, k, v)]
        with torch.no_grad():
            out = context_parallel_attention(*local, cp, window=window)
        torch.testing.assert_close(out, split_for_context(ref.detach(), cp))
    finally:
        context.block_attention_forward, context._blocks_and_masks = forward, choose
    return cp.rank, calls, chosen


def test_ring_computes_only_the_chunk_pairs_the_window_reaches():
    """cp4, 32 tokens in chunks of 4, window 3: a chunk pair is computed iff some query in it sees some key
    (brute force over the whole mask); every other pair (most of them) is skipped, never computed."""
    window, c = 3, 4
    keep = torch.tensor([[0 <= i - j < window for j in range(32)] for i in range(32)])
    total = 0
    for rank, calls, chosen in run_on_ranks(4, _ring_pairs, window, layout=ParallelLayout(cp=4)):
        positions = {r: local_positions(32, 4, r) for r in range(4)}
        want = set()
        for source in range(4):
            for i in (0, c):
                for j in (0, c):
                    rows, cols = positions[rank][i : i + c], positions[source][j : j + c]
                    if keep[rows][:, cols].any():
                        want.add((source, i, j))
        assert set(chosen) == want and len(chosen) == len(want), (rank, chosen)
        assert calls == [(c, c)] * len(want), rank  # one c x c block per chosen pair, nothing else
        total += len(want)
    assert total == 8 + 7  # the 8 chunks with themselves and chunks 1..7 with the one before: 15 of 64 pairs


def test_flops_count_only_the_pairs_a_window_attends():
    """Window 5 on layer 0 of 16 tokens: the convention's 16 keys per token (twice the causal pairs per token)
    become twice the window's pairs per token on that layer; the global layer and the projections are unchanged."""
    from modelpar.model.flops import attention_keys, half_block_training_flops, training_flops_per_token

    pairs = sum(min(i + 1, 5) for i in range(16))  # the causal window's attended pairs, brute force
    assert attention_keys(CONFIG, 16, 0) == pytest.approx(2 * pairs / 16)
    assert attention_keys(CONFIG, 16, 1) == 16 and attention_keys(CONFIG, 4, 0) == 4  # a window >= s is full
    full = ModelConfig(**{**CONFIG.__dict__, "sliding_window": 0, "window_layers": []})
    saved = 12 * CONFIG.hidden * (16 - 2 * pairs / 16)
    assert training_flops_per_token(full, 16) - training_flops_per_token(CONFIG, 16) == pytest.approx(saved)
    assert half_block_training_flops(full, 16, 0)[0] - half_block_training_flops(CONFIG, 16, 0)[0] == pytest.approx(
        saved
    )
