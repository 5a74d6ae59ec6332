"""Which transformer blocks each pipeline rank holds.

The ``n_layers`` blocks are cut into ``pp * vpp`` contiguous model chunks (virtual stages). Chunk ``c``
lives on rank ``c % pp`` as that rank's local chunk ``c // pp`` (Megatron's interleaving)::

    pp=2, vpp=2, 8 layers, uniform:   chunk   0      1      2      3
                                      layers  0-1    2-3    4-5    6-7
                                      rank    0      1      0      1     (local chunk 0, 0, 1, 1)

Under the V placement (``modelpar.pipeline.placement``, schedules zbv and dualpipev) rank ``r`` holds chunks
``r`` and ``2 * pp - 1 - r`` instead; a partition carries its placement and every question about ranks below
goes through it.

The first chunk also holds the embedding; the last holds the final norm, the head and the loss.

A count may end in .5: the split then falls inside a block, between its attention half (``x + attn(norm(x))``)
and its MLP half (``x + mlp(norm(x))``). Both halves pass the same residual stream on, so a pipeline can cut
there at no extra cost, and balancing in half blocks evens out stages that whole blocks cannot::

    pp=2, 8 layers, counts (4.5, 3.5):   chunk 0: blocks 0-3 and block 4's attention
                                         chunk 1: block 4's MLP, blocks 5-7, the head
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from modelpar.pipeline.placement import Placement


class PartitionError(ValueError):
    """An impossible split of layers into chunks; the message is one line naming the fix."""


@dataclass(frozen=True)
class Partition:
    """Layer counts of each model chunk, in model order, for ``pp`` ranks with ``vpp`` chunks each.

    Counts are whole or half blocks (``4`` or ``4.5``); see the module docstring for what a half holds.
    """

    pp: int
    vpp: int
    layer_counts: tuple[float, ...]
    placement: Placement = Placement.INTERLEAVED

    def __post_init__(self) -> None:
        if len(self.layer_counts) != self.pp * self.vpp:
            raise PartitionError(
                f"{len(self.layer_counts)} layer counts for pp*vpp={self.pp * self.vpp} chunks; "
                f"give exactly {self.pp * self.vpp}"
            )
        object.__setattr__(self, "layer_counts", tuple(_layer_count(c) for c in self.layer_counts))

    @property
    def n_chunks(self) -> int:
        return self.pp * self.vpp

    @property
    def n_layers(self) -> int:
        return round(sum(self.layer_counts))

    def half_range(self, chunk: int) -> tuple[int, int]:
        """[start, stop) of chunk ``chunk`` in half blocks: half 2i is block i's attention, 2i+1 its MLP."""
        start = round(2 * sum(self.layer_counts[:chunk]))
        return start, start + round(2 * self.layer_counts[chunk])

    def layers(self, chunk: int) -> range:
        """Global indices of the blocks in model chunk ``chunk``, including a block it holds only half of."""
        start, stop = self.half_range(chunk)
        return range(start // 2, (stop + 1) // 2 if stop > start else start // 2)

    def split_blocks(self, chunk: int) -> dict[int, str]:
        """Blocks of which chunk ``chunk`` holds only one half: block id -> ``"attention"`` or ``"mlp"``."""
        start, stop = self.half_range(chunk)
        if start == stop:
            return {}
        split = {}
        if start % 2:
            split[start // 2] = "mlp"
        if stop % 2:
            split[stop // 2] = "attention"
        return split

    def rank_of(self, chunk: int) -> int:
        return self.placement.locate(chunk, self.pp)[0]

    def local_index(self, chunk: int) -> int:
        return self.placement.locate(chunk, self.pp)[1]

    def chunks_of(self, rank: int) -> list[int]:
        """Model chunks on ``rank``, in local-chunk order."""
        return self.placement.chunks_of(rank, self.pp, self.vpp)

    def has_embedding(self, chunk: int) -> bool:
        return chunk == 0

    def has_head(self, chunk: int) -> bool:
        """The last chunk holds the final norm, the output head and the loss."""
        return chunk == self.n_chunks - 1


def partition_uniform(n_layers: int, pp: int, vpp: int = 1) -> Partition:
    """As even as possible; when ``pp * vpp`` does not divide ``n_layers``, the spare layers go to the middle
    chunks first, because the first and last chunks also carry the embedding and the head."""
    chunks = _check_counts(n_layers, pp, vpp)
    base, spare = divmod(n_layers, chunks)
    middle_first = sorted(range(chunks), key=lambda c: (c in (0, chunks - 1), abs(2 * c - (chunks - 1)), c))
    counts = [base] * chunks
    for c in middle_first[:spare]:
        counts[c] += 1
    return Partition(pp, vpp, tuple(counts))


def partition_by_cost(
    layer_costs: Sequence[float],
    pp: int,
    vpp: int = 1,
    *,
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
    halves: bool = False,
) -> Partition:
    """Contiguous chunks minimising the costliest chunk, e.g. with parameter counts as costs.

    ``embedding_cost`` is added to the first chunk and ``head_cost`` to the last. With ``halves`` the costs are
    per half block (attention, MLP, attention, ... : two per layer) and chunks may end inside a block. Every
    chunk gets at least one unit (layer, or half with ``halves``). Exact dynamic programme over split points:
    ``O(chunks * n^2)``, trivial for real layer counts.
    """
    n = len(layer_costs)
    if halves and n % 2:
        raise PartitionError(f"{n} half-block costs: give two per layer (attention, MLP)")
    chunks = _check_counts(n, pp, vpp, unit="half blocks" if halves else "layers")
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + float(cost))

    # best[c][i]: smallest possible max cost when chunks 0..c-1 hold layers 0..i-1
    # (each row vectorised over the split point j; argmin takes the first of equal values, as a strict < would)
    inf = float("inf")
    ends = np.asarray(prefix, dtype=np.float64)
    best = np.full((chunks + 1, n + 1), inf)
    cut = np.zeros((chunks + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for c in range(1, chunks + 1):
        extra = (embedding_cost if c == 1 else 0.0) + (head_cost if c == chunks else 0.0)
        for i in range(c, n - (chunks - c) + 1):
            values = np.maximum(best[c - 1, c - 1 : i], (ends[i] - ends[c - 1 : i]) + extra)
            j = int(np.argmin(values))
            best[c, i], cut[c, i] = values[j], c - 1 + j
    counts, i = [], n
    for c in range(chunks, 0, -1):
        counts.append(i - int(cut[c, i]))
        i = int(cut[c, i])
    counts.reverse()
    return Partition(pp, vpp, tuple(c / 2 for c in counts) if halves else tuple(counts))


def partition_explicit(layer_counts: Sequence[int], n_layers: int, pp: int, vpp: int = 1) -> Partition:
    """Take the user's layer count per chunk (model order); it must have ``pp * vpp`` entries summing to
    ``n_layers``. A count may end in .5 (the chunk ends inside a block, see the module docstring). A chunk may
    hold zero blocks (e.g. a last stage with only the head)."""
    counts = tuple(layer_counts)
    chunks = pp * vpp
    if len(counts) != chunks:
        raise PartitionError(
            f"layer counts {list(counts)} have {len(counts)} entries but pp*vpp={chunks}; give one count per chunk"
        )
    if any(not isinstance(c, int | float) or isinstance(c, bool) or c < 0 or (2 * c) % 1 for c in counts):
        raise PartitionError(f"layer counts {list(counts)} must be whole or half numbers >= 0, e.g. 4 or 4.5")
    counts = tuple(_layer_count(c) for c in counts)
    if sum(counts) != n_layers:
        raise PartitionError(
            f"layer counts {list(counts)} sum to {sum(counts)}, not the model's {n_layers} layers; "
            f"e.g. {list(partition_uniform(n_layers, pp, vpp).layer_counts)}"
            if n_layers >= chunks
            else f"layer counts {list(counts)} sum to {sum(counts)}, not the model's {n_layers} layers"
        )
    return Partition(pp, vpp, counts)


def parameter_counts(blocks: Sequence[torch.nn.Module]) -> list[int]:
    """Parameters per block, the usual cost for ``partition_by_cost``."""
    return [sum(p.numel() for p in block.parameters()) for block in blocks]


def _layer_count(count: float) -> float:
    """A whole count as int, a half count as float; anything else is refused."""
    if isinstance(count, bool) or (2 * count) % 1:
        raise PartitionError(f"layer count {count!r} must be a whole or half number, e.g. 4 or 4.5")
    return int(count) if float(count).is_integer() else float(count)


def _check_counts(n_layers: int, pp: int, vpp: int, unit: str = "layers") -> int:
    for name, value in (("n_layers", n_layers), ("pp", pp), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PartitionError(f"{name}={value!r} must be a positive integer")
    chunks = pp * vpp
    if chunks > n_layers:
        raise PartitionError(
            f"pp*vpp={chunks} chunks exceed the {n_layers} {unit} (each chunk needs one); use pp*vpp <= {n_layers}"
        )
    return chunks
