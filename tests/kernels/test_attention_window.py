"""Sliding-window attention and a v head dim unlike q/k's, in the flash kernels and the torch reference.

The window's mask against a brute-force ``i - j < W`` (its boundary included), the Triton kernel against the
torch reference (causal, GQA, documents, a block of earlier keys with an offset, rows that see nothing), and
that kv tiles outside every row's window are never read (NaN planted there stays out of the result).
"""

import pytest
import torch
import torch.nn.functional as F
from modelpar_kernels import BlockMask, attention, block_attention_backward, block_attention_forward
from modelpar_kernels.attention import window_keep
from modelpar_kernels.grid import INTERPRETER_TILE

from tests.kernels import ATTENTION_FP32_TOL, DEVICE, assert_close


def _qkv(b, s, hq, hkv, d, dv, gen, sk=None):
    sk = sk or s
    shapes = ((b, s, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv))
    return [torch.randn(shape, generator=gen).to(DEVICE) for shape in shapes]


def _with_grads(fn, q, k, v, grad):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def _compare(got, want, what=""):
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want, strict=True):
        assert_close(a, b, ATTENTION_FP32_TOL, f"{what} {name}")


def test_window_mask_is_the_last_w_positions_up_to_the_query():
    """Query i sees key j iff 0 <= i - j < W: key i-W+1 is the oldest visible, key i-W is not."""
    sq, sk, w = 9, 9, 3
    brute = torch.tensor([[0 <= i - j < w for j in range(sk)] for i in range(sq)])
    assert torch.equal(window_keep(sq, sk, True, w), brute)
    assert window_keep(sq, sk, True, w)[5].nonzero().flatten().tolist() == [3, 4, 5]
    # a block of earlier keys: q positions start `offset` after k's, no causal bound
    brute = torch.tensor([[i + 6 - j < w for j in range(5)] for i in range(4)])
    assert torch.equal(window_keep(4, 5, False, w, offset=6), brute)


@pytest.mark.parametrize(
    "hq, hkv, d, dv, window",
    [(4, 2, 16, 16, 5), (4, 1, 16, 16, 16), (2, 2, 24, 16, 23), (2, 1, 24, 16, 0), (2, 2, 16, 32, 2)],
    ids=["gqa2-w5", "gqa4-w16", "dk24-dv16-w23", "dk24-dv16-full", "dv32-w2"],
)
def test_kernel_matches_reference(hq, hkv, d, dv, window):
    """Windows shorter than a tile, one tile, crossing tiles, none, and only the query itself; dk != dv."""
    gen = torch.Generator().manual_seed(window + d)
    q, k, v = _qkv(2, 37, hq, hkv, d, dv, gen)
    grad = torch.randn(2, 37, hq, dv, generator=gen).to(DEVICE)
    got = _with_grads(lambda q, k, v: attention(q, k, v, backend="triton", window=window), q, k, v, grad)
    want = _with_grads(lambda q, k, v: attention(q, k, v, backend="torch", window=window), q, k, v, grad)
    _compare(got, want)
    assert got[0].shape == (2, 37, hq, dv)


def test_explicit_scale_matches_reference():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(1, 21, 2, 1, 24, 16, gen)
    grad = torch.randn(1, 21, 2, 16, generator=gen).to(DEVICE)
    got = _with_grads(lambda q, k, v: attention(q, k, v, backend="triton", window=7, scale=0.3), q, k, v, grad)
    want = _with_grads(lambda q, k, v: attention(q, k, v, backend="torch", window=7, scale=0.3), q, k, v, grad)
    _compare(got, want)


def test_documents_and_window_compose():
    """A key must be in the query's document AND among its W latest positions."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = _qkv(2, 37, 4, 2, 24, 16, gen)
    ends = torch.rand(2, 37, generator=gen) < 0.15
    docs = (torch.cumsum(ends.int(), 1) - ends.int()).to(DEVICE)
    grad = torch.randn(2, 37, 4, 16, generator=gen).to(DEVICE)
    keep = (docs[:, None, :, None] == docs[:, None, None, :]) & window_keep(37, 37, True, 6, device=DEVICE)

    def reference(q, k, v):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, enable_gqa=True).transpose(1, 2)

    got = _with_grads(lambda q, k, v: attention(q, k, v, backend="triton", documents=docs, window=6), q, k, v, grad)
    _compare(got, _with_grads(reference, q, k, v, grad))


@pytest.mark.parametrize("dv", [16, 8], ids=["dv16", "dv8"])
def test_a_block_of_earlier_keys_under_a_window_matches_the_torch_block(dv):
    """q positions 40.. against keys 20..43 (offset 20), window 10: the later rows see no key of the block (lse
    -inf, zero output); forward and backward from a merged lse equal the torch block path (the math path when
    dv != d)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (t.transpose(1, 2) for t in _qkv(1, 30, 4, 2, 16, dv, gen, sk=24))
    mask = BlockMask(False, window=10, offset=20)
    out, lse = block_attention_forward(q, k, v, mask, "triton")
    want_out, want_lse = block_attention_forward(q, k, v, mask, "torch")
    assert bool(torch.isinf(lse).any()) and bool(torch.isfinite(lse).any())
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert_close(out, want_out, ATTENTION_FP32_TOL, "out")
    assert_close(torch.where(torch.isinf(lse), 0.0, lse), torch.where(torch.isinf(want_lse), 0.0, want_lse), 1e-5)
    merged = torch.where(torch.isinf(lse), 0.0, lse)  # as if another block gave the empty rows their keys
    dout = torch.randn(out.shape, generator=gen).to(DEVICE)
    got = block_attention_backward(dout, q, k, v, out, merged, mask, "triton")
    want = block_attention_backward(dout, q, k, v, want_out, merged, mask, "torch")
    for name, a, b in zip(["dq", "dk", "dv"], got, want, strict=True):
        assert_close(a, b, ATTENTION_FP32_TOL, name)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the planted NaN, in the tiles that may see it
def test_kv_tiles_outside_every_window_are_never_read():
    """NaN in the first kv tile: rows whose q tiles start past its reach (window 8, interpreter tiles of 16)
    come out finite and exact, so neither forward nor dq visits that tile for them; NaN in the last q tile's
    q and dout leaves dk/dv of the first kv tile finite, so dk/dv never visits that q tile for it."""
    if DEVICE != "cpu":
        pytest.skip("the tile bounds asserted are those of the interpreter's 16 x 16 tiles")
    tile, w, s = INTERPRETER_TILE["BLOCK_N"], 8, 64
    gen = torch.Generator().manual_seed(6)
    q, k, v = _qkv(1, s, 2, 1, 16, 16, gen)
    grad = torch.randn(1, s, 2, 16, generator=gen)
    clean = _with_grads(lambda q, k, v: attention(q, k, v, backend="torch", window=w), q, k, v, grad)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :tile], v_bad[:, :tile] = float("nan"), float("nan")
    out, dq, _, _ = _with_grads(lambda q, k, v: attention(q, k, v, backend="triton", window=w), q, k_bad, v_bad, grad)
    reach = 2 * tile  # q tiles from here start more than W past the first kv tile's last key
    assert_close(out[:, reach:], clean[0][:, reach:], ATTENTION_FP32_TOL, "out")
    assert_close(dq[:, reach:], clean[1][:, reach:], ATTENTION_FP32_TOL, "dq")
    q_bad, grad_bad = q.clone(), grad.clone()
    q_bad[:, -tile:], grad_bad[:, -tile:] = float("nan"), float("nan")
    _, _, dk, dv = _with_grads(lambda q, k, v: attention(q, k, v, backend="triton", window=w), q_bad, k, v, grad_bad)
    assert_close(dk[:, :tile], clean[2][:, :tile], ATTENTION_FP32_TOL, "dk")
    assert_close(dv[:, :tile], clean[3][:, :tile], ATTENTION_FP32_TOL, "dv")


def test_bad_window_and_v_shape_are_rejected():
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(1, 8, 2, 1, 16, 16, gen)
    with pytest.raises(ValueError, match="window=-1 must be >= 0"):
        attention(q, k, v, backend="triton", window=-1)
    with pytest.raises(ValueError, match="hkv, dv"):
        attention(q, k, v[:, :5], backend="triton")
