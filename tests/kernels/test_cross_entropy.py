"""Vocab-parallel cross-entropy: the Triton loss and logits gradient equal the torch reference at tp=1 and tp=2."""

import pytest
import torch
from modelpar_kernels import vocab_parallel_cross_entropy
from modelpar_kernels.grid import interpreting

from modelpar import ParallelLayout
from modelpar.parallel.collectives import all_reduce, record_comm
from modelpar.testing import current_groups, run_on_ranks
from tests.kernels import BF16_TOL, DEVICE, FP32_TOL, assert_close, requires_cuda

IGNORE = -100


def _targets(n, vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab_size, (n,), generator=g)
    targets[::5] = IGNORE
    return targets


def _loss_and_grad(backend, logits, targets, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    # The Triton path consumes its input buffer, so it gets a copy (as the model hands it the head's output).
    loss = vocab_parallel_cross_entropy(leaf.clone(), targets, backend=backend, **kwargs)
    (1.7 * loss).backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize(
    "n,padded_vocab,vocab_size",
    [(37, 100, 100), (37, 100, 90), (5, 5000, 4999)],
    ids=["exact", "padded", "several-blocks-per-row"],
)
def test_loss_and_gradient_match_reference_at_tp1(n, padded_vocab, vocab_size):
    torch.manual_seed(0)
    logits = 3 * torch.randn(n, padded_vocab, device=DEVICE)
    targets = _targets(n, vocab_size).to(DEVICE)
    loss, grad = _loss_and_grad("triton", logits, targets, vocab_size=vocab_size, ignore_index=IGNORE)
    ref_loss, ref_grad = _loss_and_grad("torch", logits, targets, vocab_size=vocab_size, ignore_index=IGNORE)
    assert_close(loss, ref_loss, FP32_TOL, "loss")
    assert_close(grad, ref_grad, FP32_TOL, "dlogits")
    assert grad[:, vocab_size:].abs().max().item() == 0 if vocab_size < padded_vocab else True
    assert grad[targets == IGNORE].abs().max().item() == 0


def test_logits_buffer_holds_the_gradient_after_the_call():
    torch.manual_seed(1)
    logits = torch.randn(13, 40, device=DEVICE)
    targets = _targets(13, 40).to(DEVICE)
    buffer = logits.clone()
    vocab_parallel_cross_entropy(buffer, targets, backend="triton")
    _, ref_grad = _loss_and_grad("torch", logits, targets)
    assert_close(buffer, ref_grad / 1.7, FP32_TOL, "buffer")


def test_all_tokens_ignored_gives_zero_loss_and_gradient():
    logits = torch.randn(6, 40, device=DEVICE)
    targets = torch.full((6,), IGNORE, device=DEVICE)
    loss, grad = _loss_and_grad("triton", logits, targets)
    assert loss.item() == 0 and grad.abs().max().item() == 0


def _tp_shard_loss_and_grad(logits, targets, vocab_size, backend, engine_all_reduce=True):
    """This rank's loss, logits gradient and the collectives ``record_comm`` saw; the engine's ``all_reduce``
    is passed in (as ``vocab_parallel_loss`` does), or left to the kernel's torch.distributed default."""
    groups = current_groups()
    tp, rank = groups.layout.tp, groups.tp_rank
    n_local = logits.shape[1] // tp
    shard = logits[:, rank * n_local : (rank + 1) * n_local].clone().requires_grad_()
    engine = {"all_reduce": all_reduce} if engine_all_reduce else {}
    with record_comm() as log:
        loss = vocab_parallel_cross_entropy(
            shard.clone(), targets, backend=backend, vocab_start=rank * n_local, vocab_size=vocab_size,
            group=groups.tp_group, ignore_index=IGNORE, **engine,
        )  # fmt: skip
        (1.7 * loss).backward()
    return loss.detach(), shard.grad, [(e.kind, e.elements) for e in log.events]


@pytest.mark.skipif(not interpreting(), reason="emulated ranks run on CPU: needs Triton's interpreter")
@pytest.mark.parametrize("vocab_size", [100, 90, 45], ids=["exact", "padded", "last-rank-all-padding"])
def test_tp2_matches_single_device_reference(vocab_size):
    torch.manual_seed(2)
    n = 37
    logits = 3 * torch.randn(n, 100)
    targets = _targets(n, vocab_size)
    ref_loss, ref_grad = _loss_and_grad("torch", logits, targets, vocab_size=vocab_size, ignore_index=IGNORE)
    results = run_on_ranks(
        2, _tp_shard_loss_and_grad, logits, targets, vocab_size, "triton", layout=ParallelLayout(tp=2), timeout_s=300
    )
    for loss, _, events in results:
        assert_close(loss, ref_loss, FP32_TOL, "loss")
        assert events == [("all_reduce", n), ("all_reduce", 2 * n)]  # max, then (sum_exp, target logit)
    assert_close(torch.cat([grad for _, grad, _ in results], dim=1), ref_grad, FP32_TOL, "dlogits")


@pytest.mark.skipif(not interpreting(), reason="emulated ranks run on CPU: needs Triton's interpreter")
def test_tp2_without_an_engine_all_reduce_runs_torch_distributed_directly():
    """Given only a process group, the kernel reduces with torch.distributed: same loss, nothing recorded."""
    torch.manual_seed(3)
    logits, targets = 3 * torch.randn(37, 100), _targets(37, 90)
    ref_loss, ref_grad = _loss_and_grad("torch", logits, targets, vocab_size=90, ignore_index=IGNORE)
    results = run_on_ranks(
        2, _tp_shard_loss_and_grad, logits, targets, 90, "triton", False, layout=ParallelLayout(tp=2), timeout_s=300
    )
    for loss, _, events in results:
        assert_close(loss, ref_loss, FP32_TOL, "loss")
        assert events == []
    assert_close(torch.cat([grad for _, grad, _ in results], dim=1), ref_grad, FP32_TOL, "dlogits")


@requires_cuda
@pytest.mark.gpu
def test_bf16_matches_reference_on_gpu():
    torch.manual_seed(0)
    logits = 4 * torch.randn(4096, 32000, device="cuda", dtype=torch.bfloat16)
    targets = _targets(4096, 32000).cuda()
    loss, grad = _loss_and_grad("triton", logits, targets)
    ref_loss, ref_grad = _loss_and_grad("torch", logits, targets)
    assert_close(loss, ref_loss, BF16_TOL, "loss")
    assert_close(grad, ref_grad, BF16_TOL, "dlogits")
