"""The flash kernel's document mask and its blocks: document-causal attention equals masked SDPA, a block's
(out, lse) merge into the whole attention, a block's backward from the merged lse sums to the whole gradient,
and the ring and the all-gather over 2 ranks on the kernel equal full attention."""

import pytest
import torch
import torch.nn.functional as F
from modelpar_kernels import attention, attention_block_backward, attention_block_forward

from tests.kernels import ATTENTION_FP32_TOL, DEVICE, assert_close


def _masked_reference(q, k, v, documents, causal=True):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    keep = keep.tril() if causal else keep
    if documents is not None:
        q_docs, k_docs = documents
        keep = keep & (q_docs[:, None, :, None] == k_docs[:, None, None, :])
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _documents(b, s, gen):
    ends = torch.rand(b, s, generator=gen) < 0.2
    return (torch.cumsum(ends.int(), 1) - ends.int()).to(DEVICE)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)], ids=["mha", "gqa4"])
def test_document_causal_kernel_matches_masked_sdpa(hq, hkv):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, h, 16, generator=gen).to(DEVICE) for h in (hq, hkv, hkv))
    docs = _documents(2, 37, gen)
    grad = torch.randn(q.shape, generator=gen).to(DEVICE)
    results = []
    for fn in (
        lambda q, k, v: attention(q, k, v, backend="triton", documents=docs),
        lambda q, k, v: _masked_reference(q, k, v, (docs, docs)),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for name, a, b in zip(["out", "dq", "dk", "dv"], *results, strict=True):
        assert_close(a, b, ATTENTION_FP32_TOL, name)


def test_blocks_merge_into_the_whole_attention_and_their_backwards_sum_to_its_gradient():
    """Keys cut into a diagonal block (causal) and an earlier block (all visible): each block's (out, lse)
    merged by log-sum-exp gives the whole attention; each block's backward from the merged lse, summed, its
    gradient. Documents make some rows see nothing in the earlier block (lse -inf there)."""
    gen = torch.Generator().manual_seed(1)
    early, late, hq, hkv, d = 21, 19, 4, 2, 16
    q = torch.randn(1, late, hq, d, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, early + late, hkv, d, generator=gen).to(DEVICE) for _ in range(2))
    docs = _documents(1, early + late, gen)
    docs[0, early + 5 :] += 1  # the late rows past 5 start a document the early keys do not belong to
    grad = torch.randn(q.shape, generator=gen).to(DEVICE)
    # the whole: late queries over every key, document-causal
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    q_docs = docs[:, early:]
    qt, kt, vt = (t.transpose(1, 2) for t in leaves)
    keep = torch.ones(late, early + late, dtype=torch.bool, device=DEVICE).tril(early)
    keep = keep & (q_docs[:, None, :, None] == docs[:, None, None, :])
    whole = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, enable_gqa=True).transpose(1, 2)
    whole.backward(grad)
    parts = [(k[:, early:], v[:, early:], True, docs[:, early:]), (k[:, :early], v[:, :early], False, docs[:, :early])]
    outs = [attention_block_forward(q, kb, vb, causal, q_docs, kd) for kb, vb, causal, kd in parts]
    assert bool(torch.isinf(outs[1][1]).any())
    lse = torch.logaddexp(outs[0][1], outs[1][1])  # [b, hq, sq]
    out = sum(o * torch.exp(part - lse).transpose(1, 2)[..., None] for o, part in outs)
    assert_close(out, whole.detach(), ATTENTION_FP32_TOL, "out")
    grads = [attention_block_backward(grad, q, kb, vb, out, lse, c, q_docs, kd) for kb, vb, c, kd in parts]
    assert_close(grads[0][0] + grads[1][0], leaves[0].grad, ATTENTION_FP32_TOL, "dq")
    assert_close(torch.cat([grads[1][1], grads[0][1]], 1), leaves[1].grad, ATTENTION_FP32_TOL, "dk")
    assert_close(torch.cat([grads[1][2], grads[0][2]], 1), leaves[2].grad, ATTENTION_FP32_TOL, "dv")


def _cp_on_the_kernel(comm, with_documents):
    from modelpar.parallel.context import ContextParallelGroup, context_parallel_attention, split_for_context
    from modelpar.testing import current_groups

    cp = ContextParallelGroup.of(current_groups(), comm)
    gen = torch.Generator().manual_seed(2)
    q, k, v, grad = (torch.randn(1, 24, h, 16, generator=gen) for h in (2, 1, 1, 2))
    docs = _documents(1, 24, gen) if with_documents else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    whole = _masked_reference(*leaves, None if docs is None else (docs, docs))
    whole.backward(grad)
    local = [split_for_context(t, cp).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, cp, docs, backend="triton")
    out.backward(split_for_context(grad, cp))
    assert_close(out, split_for_context(whole.detach(), cp), ATTENTION_FP32_TOL, "out")
    for name, mine, ref in zip("qkv", local, leaves, strict=True):
        assert_close(mine.grad, split_for_context(ref.grad, cp), ATTENTION_FP32_TOL, f"d{name}")


@pytest.mark.parametrize(
    "comm, with_documents",
    [("ring", False), ("ring", True), ("allgather", True)],
    ids=["ring", "ring-docs", "allgather-docs"],
)
def test_cp_on_the_kernel_matches_full_attention_on_2_ranks(comm, with_documents):
    from modelpar.parallel.layout import ParallelLayout
    from modelpar.testing import run_on_ranks

    if DEVICE != "cpu":
        pytest.skip("emulated ranks run on CPU")
    run_on_ranks(2, _cp_on_the_kernel, comm, with_documents, layout=ParallelLayout(cp=2))
