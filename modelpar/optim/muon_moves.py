"""A fixed index map (``src[index]``, ``dst[index] = values``) compiled once into whole slices where it runs.

Muon's owner exchange moves every element of a step through four fixed index maps (``muon_exchange``): what
a rank sends, where the owner places it, what it serves back, where each piece's result lies. Under ZeRO-1 and
whole parameters those maps are long contiguous stretches (a piece's elements of one matrix stay together),
so a copy of each stretch, or a view where one stretch is all, moves the same values as an indexed gather
or scatter without reading an index per element; a scattered map (tp column blocks split into short rows)
stays an ``index_select`` / ``index_copy_``. Either way the values moved are the same, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_RUN = 4096  # mean elements per stretch below which the map stays an index (a slice copy each costs more)


def runs_of(index: torch.Tensor) -> list[tuple[int, int]]:
    """``index`` (long, 1-D, host) as ``(start, length)`` stretches of consecutive values, in order."""
    if index.numel() == 0:
        return []
    cuts = ((index[1:] - index[:-1]) != 1).nonzero().squeeze(1) + 1
    bounds = [0, *cuts.tolist(), index.numel()]
    starts = index[torch.tensor(bounds[:-1], dtype=torch.long)].tolist()
    return [(s, b - a) for s, a, b in zip(starts, bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class Take:
    """``src[index]`` for a fixed ``index`` (built by ``Take.of``): as ``runs`` (``(start in src, length)``,
    in order) where they are long, else by ``index``."""

    numel: int
    runs: tuple[tuple[int, int], ...] | None
    index: torch.Tensor | None

    @classmethod
    def of(cls, index: torch.Tensor, min_run: int | None = None) -> Take:
        runs = runs_of(index.cpu())
        if len(runs) * (MIN_RUN if min_run is None else min_run) <= index.numel():
            return cls(int(index.numel()), tuple(runs), None)
        return cls(int(index.numel()), None, index)

    def is_identity(self, numel: int) -> bool:
        """Whether ``src[index]`` is ``src`` itself for a ``src`` of ``numel`` elements."""
        return self.numel == numel and (numel == 0 or self.runs == ((0, numel),))

    def to(self, device: torch.device) -> Take:
        return self if self.index is None else Take(self.numel, None, self.index.to(device))

    def __call__(self, src: torch.Tensor) -> torch.Tensor:
        """``src[index]`` (1-D): a view where it is one stretch."""
        if self.index is not None:
            return src.index_select(0, self.index)
        if len(self.runs) == 1:
            start, n = self.runs[0]
            return src[start : start + n]
        return torch.cat([src[start : start + n] for start, n in self.runs]) if self.runs else src[:0]

    def segments(self, src: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``src[index]`` as ``(offset in the result, values)`` parts: views of ``src``, one per stretch, or one
        gathered part."""
        if self.index is not None:
            return [(0, src.index_select(0, self.index))]
        out, at = [], 0
        for start, n in self.runs:
            out.append((at, src[start : start + n]))
            at += n
        return out

    def put(self, dst: torch.Tensor, values: torch.Tensor) -> None:
        """``dst[index] = values`` (1-D, in place)."""
        if self.index is not None:
            dst.index_copy_(0, self.index, values)
            return
        at = 0
        for start, n in self.runs:
            dst[start : start + n].copy_(values[at : at + n])
            at += n


__all__ = ["MIN_RUN", "Take", "runs_of"]
