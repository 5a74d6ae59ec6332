"""MXFP4 dequantisation (GPT-OSS's released experts) equals transformers' own dequantiser bit for bit."""

from __future__ import annotations

import pytest
import torch

from modelpar.model.mxfp4 import E2M1, dequantize_mxfp4, mxfp4_expert, quantize_mxfp4

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def test_every_code_and_scale_dequantises_as_transformers_does():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 8, 4), dtype=torch.uint8, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, G * 32, rows]
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2), theirs)
        assert torch.equal(mxfp4_expert(blocks[1], scales[1], dtype), theirs[1])


def test_a_hand_quantised_tensor_round_trips_within_its_block_scale():
    w = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (2, 16, 2, 16) and scales.shape == (2, 16, 2)
    back = dequantize_mxfp4(blocks, scales, torch.float32)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)  # the scale of each value's block
    assert ((back - w).abs() <= step).all()  # E2M1's widest gap (4 to 6) is two scales: half of it at most
    assert torch.equal(mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2), back)


def test_the_low_nibble_is_the_even_element():
    blocks = torch.tensor([[[0x71] + [0] * 15]], dtype=torch.uint8)  # low 1 -> 0.5, high 7 -> 6.0
    out = dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert out[0, :2].tolist() == [2 * E2M1[1], 2 * E2M1[7]]


def test_blocks_and_scales_that_do_not_pair_are_one_line():
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))
