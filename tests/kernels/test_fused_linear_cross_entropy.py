"""Chunked head + cross-entropy: loss and hidden/weight gradients equal projection-then-reference, tp=1 and tp=2."""

import pytest
import torch
from modelpar_kernels import fused_linear_cross_entropy
from modelpar_kernels.launch import interpreting

from modelpar import ParallelLayout
from modelpar.parallel.collectives import record_comm
from modelpar.testing import current_groups, run_on_ranks
from tests.kernels import BF16_TOL, DEVICE, FP32_TOL, assert_close, requires_cuda

IGNORE = -100


def _targets(n, vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab_size, (n,), generator=g)
    targets[1::4] = IGNORE
    return targets


def _loss_and_grads(backend, hidden, weight, targets, **kwargs):
    hidden, weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    loss = fused_linear_cross_entropy(hidden, weight, targets, backend=backend, ignore_index=IGNORE, **kwargs)
    (0.3 * loss).backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [8, 64, None], ids=["ragged-chunks", "one-chunk", "default"])
@pytest.mark.parametrize("vocab_size", [100, 90], ids=["exact", "padded"])
def test_loss_and_gradients_match_reference_at_tp1(chunk_size, vocab_size):
    torch.manual_seed(0)
    hidden = torch.randn(37, 24, device=DEVICE)
    weight = torch.randn(100, 24, device=DEVICE) / 4
    targets = _targets(37, vocab_size).to(DEVICE)
    got = _loss_and_grads("triton", hidden, weight, targets, vocab_size=vocab_size, chunk_size=chunk_size)
    want = _loss_and_grads("torch", hidden, weight, targets, vocab_size=vocab_size)
    for name, a, b in zip(["loss", "dhidden", "dweight"], got, want, strict=True):
        assert_close(a, b, FP32_TOL, name)


def _tp_shard(hidden, weight, targets, vocab_size, chunk_size):
    groups = current_groups()
    tp, rank = groups.layout.tp, groups.tp_rank
    n_local = weight.shape[0] // tp
    hidden = hidden.clone().requires_grad_()
    shard = weight[rank * n_local : (rank + 1) * n_local].clone().requires_grad_()
    with record_comm() as log:
        loss = fused_linear_cross_entropy(
            hidden, shard, targets, backend="triton", vocab_start=rank * n_local, vocab_size=vocab_size,
            group=groups.tp_group, ignore_index=IGNORE, chunk_size=chunk_size,
        )  # fmt: skip
        (0.3 * loss).backward()
    return loss.detach(), hidden.grad, shard.grad, [e.elements for e in log.events]


@pytest.mark.skipif(not interpreting(), reason="emulated ranks run on CPU: needs Triton's interpreter")
def test_tp2_matches_single_device_reference_chunk_by_chunk():
    """Each rank's hidden gradient is its partial sum (the caller's copy-to-tp op all-reduces it)."""
    torch.manual_seed(1)
    hidden, weight = torch.randn(37, 24), torch.randn(100, 24) / 4
    targets = _targets(37, 90)
    ref_loss, ref_dhidden, ref_dweight = _loss_and_grads("torch", hidden, weight, targets, vocab_size=90)
    results = run_on_ranks(2, _tp_shard, hidden, weight, targets, 90, 16, layout=ParallelLayout(tp=2), timeout_s=300)
    for loss, _, _, elements in results:
        assert_close(loss, ref_loss, FP32_TOL, "loss")
        assert elements == [16, 32, 16, 32, 5, 10]  # two small all-reduces per chunk of <= 16 tokens
    assert_close(sum(dhidden for _, dhidden, _, _ in results), ref_dhidden, FP32_TOL, "dhidden")
    assert_close(torch.cat([dweight for _, _, dweight, _ in results]), ref_dweight, FP32_TOL, "dweight")


@requires_cuda
@pytest.mark.gpu
def test_bf16_matches_reference_on_gpu():
    torch.manual_seed(0)
    hidden = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(32000, 2048, device="cuda", dtype=torch.bfloat16) / 32
    targets = _targets(4096, 32000).cuda()
    got = _loss_and_grads("triton", hidden, weight, targets)
    want = _loss_and_grads("torch", hidden, weight, targets)
    for name, a, b in zip(["loss", "dhidden", "dweight"], got, want, strict=True):
        assert_close(a, b, BF16_TOL, name)
