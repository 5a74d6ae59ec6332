"""Layout-invariant initialisation: the same seed gives the same global weights for every tp and pp.

Each logical tensor (HF Llama name, e.g. ``layers.3.mlp.up_proj.weight``) is drawn whole from its own
generator, seeded by ``(seed, name)``, and each rank keeps its slice. No draw depends on which other tensors a
rank holds or in what order it builds them.
"""

from __future__ import annotations

import hashlib
import math

import torch


def logical_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for logical tensor ``name`` (the same in every process and Python version)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_logical(
    name: str, shape: tuple[int, ...], *, seed: int, std: float, layers: int, norm_offset: float = 0.0
) -> torch.Tensor:
    """The full initial value (fp32, CPU) of logical tensor ``name`` of global ``shape``.

    Norm weights are ones (zeros with ``norm_offset`` 1: a norm scaled by 1 + weight starts at one), a
    router's balancing bias and every projection's bias zeros; every matrix is N(0, std^2), except the
    projections that write into the residual stream (o_proj, down_proj, an expert's w2), whose std is divided by
    sqrt(2 * layers) as in GPT-2.
    """
    if name.endswith("norm.weight"):
        return torch.full(shape, 1.0 - norm_offset)
    if name.endswith(("e_score_correction_bias", ".bias")):  # balancing and projection biases start neutral
        return torch.zeros(shape)
    if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):
        std = std / math.sqrt(2 * layers)
    generator = torch.Generator().manual_seed(logical_seed(seed, name))
    return torch.randn(shape, generator=generator) * std
