"""The step's one host sync: named device tensors packed into one buffer, read back once, unpacked by name.

read = ReadBack()
read.add("loss", loss)                 # 0-d or any shape, any float dtype, on the device
read.add("moe", table)
values = read.values()                 # the one .tolist(): {"loss": [2.31], "moe": [...]}
"""

from __future__ import annotations

import torch


class ReadBack:
    """Device tensors by name, read back to the host together (float64: counts and losses stay exact)."""

    def __init__(self) -> None:
        self._parts: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        if name in self._parts:
            raise ValueError(f"read-back value {name!r} added twice")
        self._parts[name] = value

    def values(self) -> dict[str, list[float]]:
        """Every added tensor's values, flattened, by name; one device-to-host copy for all of them."""
        if not self._parts:
            return {}
        first = next(iter(self._parts.values()))
        flat = [t.to(device=first.device, dtype=torch.float64).reshape(-1) for t in self._parts.values()]
        values = torch.cat(flat).tolist()
        out, start = {}, 0
        for name, t in zip(self._parts, flat, strict=True):
            out[name] = values[start : start + t.numel()]
            start += t.numel()
        return out


__all__ = ["ReadBack"]
