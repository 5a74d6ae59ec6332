"""One block of attention with its lse on the torch backends: the plain-matmul path equals aten's CPU flash op."""

import pytest
import torch
from modelpar_kernels.block_attention import (
    BlockMask,
    _block_backward_math,
    _block_forward_math,
    block_attention_backward,
    block_attention_forward,
)


@pytest.mark.parametrize("causal", [True, False], ids=["diagonal", "masked"])
def test_plain_matmul_block_equals_the_aten_flash_block(causal):
    """The block functions' device-independent path (used where no lse-returning op exists) against the CPU op,
    including rows that see no key of the block (lse -inf, zero output)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    keep = None
    if not causal:
        q_docs = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1]])
        keep = (q_docs == 0)[:, None, :, None].expand(2, 1, 6, 6)  # keys all of document 0: only its queries see
    mask = BlockMask(causal, keep=keep)
    out, lse = block_attention_forward(q, k, v, mask)
    out_m, lse_m = _block_forward_math(q, k, v, keep, causal and keep is None)
    if keep is not None:
        lse_m = torch.where(keep.any(-1), lse_m, float("-inf"))
        assert bool(torch.isinf(lse).any())  # some rows see nothing here
    torch.testing.assert_close(out, out_m)
    torch.testing.assert_close(lse, lse_m)
    merged_lse = torch.where(torch.isinf(lse), 0.0, lse)  # as if another block had given those rows their keys
    got = block_attention_backward(dout, q, k, v, out, merged_lse, mask)
    want = _block_backward_math(dout, q, k, v, out, merged_lse, keep, causal and keep is None)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
