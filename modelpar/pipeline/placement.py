"""Which rank holds each model chunk (virtual stage): the one mapping partition, schedules, simulator,
runtime and p2p peers all read.

Local chunk ``c`` of rank ``r`` is one model chunk of ``pp * vpp``::

    interleaved (Megatron)    stage = c * pp + r                 pp=4: rank 0 holds 0, 4; rank 3 holds 3, 7
    v (zig-zag)               even c: c * pp + r                 pp=4: rank 0 holds 0, 7; rank 3 holds 3, 4
                              odd c:  c * pp + (pp - 1 - r)

Under ``v`` the activation turns around on the last rank (chunk pp-1 -> pp stay on rank pp-1, no p2p hop)
and the first rank holds both the first and the last chunk, so the loss is taken where the tokens go in.
A schedule carries its placement (``Schedule.placement``); a plain list of rows is interleaved.
"""

from __future__ import annotations

from enum import StrEnum


class Placement(StrEnum):
    """How the ``vpp`` local chunks of each of ``pp`` ranks map to model chunks."""

    INTERLEAVED = "interleaved"
    V = "v"

    def stage(self, rank: int, chunk: int, pp: int) -> int:
        """Model chunk held by ``rank`` as its local ``chunk``."""
        if self is Placement.V and chunk % 2:
            return chunk * pp + pp - 1 - rank
        return chunk * pp + rank

    def locate(self, stage: int, pp: int) -> tuple[int, int]:
        """``(rank, local chunk)`` holding model chunk ``stage``; the inverse of ``stage``."""
        chunk, offset = divmod(stage, pp)
        if self is Placement.V and chunk % 2:
            return pp - 1 - offset, chunk
        return offset, chunk

    def chunks_of(self, rank: int, pp: int, vpp: int) -> list[int]:
        """Model chunks on ``rank``, in local-chunk order."""
        return [self.stage(rank, c, pp) for c in range(vpp)]
