"""MXFP4 (the OCP microscaling format's FP4) dequantisation: GPT-OSS's released experts.

A released GPT-OSS checkpoint holds each layer's fused expert matrices (``gate_up_proj``, ``down_proj``) as
``<name>_blocks`` and ``<name>_scales`` (``quantization_config.quant_method`` mxfp4): ``blocks`` [E, rows, G,
16] uint8, two FP4 E2M1 values a byte (the low nibble the even element, the high nibble the odd one), 32 values
a block; ``scales`` [E, rows, G] uint8 E8M0 exponents with bias 127, one a block. A value is
``E2M1[nibble] * 2 ** (scale - 127)``, exact in bf16 (two mantissa bits); the rows of the matrix are the
output features, so one expert dequantises to [rows, G * 32] and, transposed, to the x @ W layout
(``modelpar.model.hf_gpt_oss``) of its slice of the unquantised tensor.
"""

from __future__ import annotations

import torch

# FP4 E2M1: sign, two exponent bits (bias 1), one mantissa bit; codes 0-7 positive, 8-15 their negatives
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127
SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks`` [..., G, 16] uint8 and ``scales`` [..., G] uint8 -> [..., G * 32] values in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype} must "
            "be uint8 [..., G, 16] and [..., G]"
        )
    lut = torch.tensor(E2M1, dtype=torch.float32)
    pairs = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = pairs.flatten(-2)  # [..., G, 32]: low nibble first
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def mxfp4_expert(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One expert's slice ``blocks[e]``, ``scales[e]`` of a fused GPT-OSS matrix, dequantised in the x @ W layout
    of the unquantised tensor's ``[e]`` ([in, out])."""
    return dequantize_mxfp4(blocks, scales, dtype).transpose(0, 1)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., n] (n a multiple of 32) -> (blocks [..., n/32, 16], scales [..., n/32]) uint8, the
    nearest E2M1 code of each value under its block's scale ``2 ** ceil(log2(max|x| / 6))`` (none clipped):
    the released checkpoints' layout, for tests and for writing quantised copies."""
    x = weight.float().reshape(*weight.shape[:-1], weight.shape[-1] // BLOCK, BLOCK)
    top = x.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = x / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(E2M1[:8])
    code = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1) + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)
