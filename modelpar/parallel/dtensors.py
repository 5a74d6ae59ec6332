"""Whether a tensor is a ``DTensor`` (FSDP2's sharded parameters), without importing ``torch.distributed.tensor``.

That package (and the symbolic-shape machinery it pulls in) costs about a second of start-up in every process
that imports it; only runs that shard with FSDP2 (ZeRO-2/3) or compare against the DTensor peers create
DTensors, and creating one imports the package. So where the package is not loaded, no tensor is a DTensor:
the engine's modules ask here instead of importing it at their top.
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(t: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t
