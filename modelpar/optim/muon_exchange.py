"""Muon's owner exchange: each matrix's pieces travel to the rank that orthogonalises it, and its result back
only to the ranks that hold pieces of it.

A pipeline stage's Muon matrices are numbered into one flat index space (``modelpar.optim.muon_layout``); a
rank holds pieces (whole tp-local parameters, ZeRO-1 segments, FSDP2 dp shards), each a list of positions in
that space, and owns whole matrices. One step is two ``all_to_all``s over the stage's ranks::

    send:  the elements this rank is the one writer of, grouped by their matrix's owner   -> all_to_all
    own:   the owner places them in a buffer of its matrices, runs Newton-Schulz on each
    serve: each result element to every rank that asked for it, grouped by that rank         -> all_to_all
    read:  each rank spreads what it got back over its pieces, by position

``Route`` is one rank's side of that, computed once (``route``): which of its elements it sends to whom, where
a received element lands, which results it serves to whom, and where each returned element goes. Every
buffer is O(this rank's pieces + the matrices it owns): the sent elements are at most its pieces, the received
ones exactly its matrices (each element has one writer), the served ones its matrices times the ranks holding
each element (one, except ZeRO-0's dp replicas and tp-replicated matrices), the returned ones its pieces.
Nothing is sized by the stage. Placing values is exact, so an owner's Newton-Schulz input, and so its output,
is bit for bit the single device's.

The planning is in pure functions of one rank's positions (``requests``, ``placements``), so the exchange is
tested in one process by simulating every rank of a stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from modelpar.optim.muon_moves import Take

Transport = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]  # (tensor, send splits, recv splits)


@dataclass(frozen=True)
class MatrixTable:
    """The stage's matrices as tensors: first flat position, owner (stage rank) and size of each, by offset;
    ``batches``: matrices with the same value (all of one shape) are orthogonalised together, in one batch."""

    starts: torch.Tensor  # long [M], ascending
    owners: torch.Tensor  # long [M]
    numels: torch.Tensor  # long [M]
    ranks: int
    batches: torch.Tensor | None = None  # long [M]; None: each matrix its own

    def owner_of(self, positions: torch.Tensor) -> torch.Tensor:
        return self.owners[self.matrix_of(positions)]

    def matrix_of(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.starts, positions, right=True) - 1

    def owned(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices of ``rank``'s matrices (those of one batch together, else ascending) and each one's offset
        in its owned buffer."""
        mine = (self.owners == rank).nonzero().squeeze(1)
        if self.batches is not None:
            mine = mine[torch.argsort(self.batches[mine], stable=True)]
        sizes = self.numels[mine]
        return mine, torch.cumsum(sizes, 0) - sizes

    def local(self, rank: int, positions: torch.Tensor) -> torch.Tensor:
        """Positions (all in ``rank``'s matrices) as offsets in ``rank``'s owned buffer."""
        mine, base = self.owned(rank)
        where = torch.full((len(self.starts),), -1, dtype=torch.long, device=self.starts.device)
        where[mine] = base
        matrix = self.matrix_of(positions)
        out = positions - self.starts[matrix] + where[matrix]
        if bool((where[matrix] < 0).any()):
            raise ValueError(f"rank {rank} was sent elements of matrices it does not own")
        return out


@dataclass(frozen=True)
class Requests:
    """What one rank asks of the others, from its own positions alone (``requests``)."""

    gather: torch.Tensor  # long [sent]: indices into the rank's concatenated pieces, grouped by owner
    send_splits: list[int]
    sent_positions: torch.Tensor  # long [sent]: their flat positions (told to the owners once)
    fetch_positions: torch.Tensor  # long [unique]: the distinct positions of its pieces, grouped by owner
    fetch_splits: list[int]
    spread: torch.Tensor  # long [pieces' elements]: each element's index in what comes back


def requests(table: MatrixTable, positions: torch.Tensor, writes: torch.Tensor) -> Requests:
    """This rank's side of the exchange from its pieces' ``positions`` and ``writes`` (flat, concatenated)."""
    written = writes.nonzero().squeeze(1)
    dest = table.owner_of(positions[written])
    order = torch.argsort(dest, stable=True)
    gather = written[order]
    distinct, inverse = torch.unique(positions, return_inverse=True)
    source = table.owner_of(distinct)
    by_owner = torch.argsort(source, stable=True)
    slot = torch.empty_like(by_owner)
    slot[by_owner] = torch.arange(len(by_owner), device=slot.device)
    return Requests(
        gather=gather,
        send_splits=torch.bincount(dest, minlength=table.ranks).tolist(),
        sent_positions=positions[gather],
        fetch_positions=distinct[by_owner],
        fetch_splits=torch.bincount(source, minlength=table.ranks).tolist(),
        spread=slot[inverse],
    )


@dataclass(frozen=True)
class Route:
    """One rank's side of every step's exchange (the module docstring), computed once by ``route``; its index
    maps compiled to slices where they run (``modelpar.optim.muon_moves``)."""

    sizes: list[int]  # each piece's elements, in the order the step passes them
    gather: Take  # the sent elements from the pieces' concatenated values, grouped by owner
    send_splits: list[int]
    recv_splits: list[int]
    place: Take  # each received element's offset in the owned buffer
    owned: list[tuple[int, tuple[int, int], list[int]]]  # (offset in the owned buffer, shape, matrix indices)
    owned_numel: int
    serve: Take  # owned-buffer offsets of the results sent back, grouped by rank
    serve_splits: list[int]
    fetch_splits: list[int]
    spread: list[Take]  # per piece: each of its elements' index in what comes back

    @property
    def covered(self) -> bool:
        """Whether the received elements fill the owned buffer (each element has one writer)."""
        return self.place.numel == self.owned_numel

    def buffer_numel(self) -> dict[str, int]:
        """Elements of each buffer a step holds on this rank (the bound the module docstring states)."""
        return {
            "sent": self.gather.numel,
            "received": self.place.numel,
            "owned": self.owned_numel,
            "served": self.serve.numel,
            "returned": sum(self.fetch_splits),
            "pieces": sum(self.sizes),
        }

    def to(self, device: torch.device) -> Route:
        move = {k: getattr(self, k).to(device) for k in ("gather", "place", "serve")}
        return Route(**{**self.__dict__, **move, "spread": [t.to(device) for t in self.spread]})

    def exchange(
        self,
        values: torch.Tensor,
        orthogonalise: Callable[[torch.Tensor, int], torch.Tensor],
        transport: Transport,
    ) -> torch.Tensor:
        """What comes back for the pieces (fp32, flat; ``pieces`` splits it) from their ``values`` (fp32, flat:
        the pieces' updates one after another, zeros for a piece without a gradient). ``orthogonalise(batch,
        indices)``: Newton-Schulz of owned matrices of one shape, ``[n, rows, cols]``; ``transport``: the
        stage's all_to_all (collective: every rank of the stage calls it twice)."""
        got = transport(self.gather(values), self.send_splits, self.recv_splits)
        if self.place.is_identity(self.owned_numel):
            owned = got
        else:
            make = torch.empty if self.covered else torch.zeros
            owned = make(self.owned_numel, dtype=torch.float32, device=values.device)
            self.place.put(owned, got)
        out = torch.empty_like(owned)
        for offset, shape, indices in self.owned:
            n = shape[0] * shape[1] * len(indices)
            batch = owned[offset : offset + n].view(len(indices), *shape)
            out[offset : offset + n].view(len(indices), *shape).copy_(orthogonalise(batch, indices))
        return transport(self.serve(out), self.serve_splits, self.fetch_splits)

    def pieces(self, back: torch.Tensor) -> list[torch.Tensor]:
        """Each piece's orthogonalised update (flat) from what ``exchange`` returned."""
        return [take(back) for take in self.spread]


def placements(
    table: MatrixTable, rank: int, shapes: Sequence[tuple[int, int]], received: torch.Tensor, asked: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[int, tuple[int, int], list[int]]], int, torch.Tensor]:
    """The owner's side: where the ``received`` positions land in its buffer, its matrices there (offset,
    shape, indices: one entry per batch), the buffer's size, and the offsets of the ``asked`` positions (its
    results to serve)."""
    mine, base = table.owned(rank)
    owned: list[tuple[int, tuple[int, int], list[int]]] = []
    batches = None if table.batches is None else table.batches[mine].tolist()
    for k, (i, b) in enumerate(zip(mine.tolist(), base.tolist(), strict=True)):
        if owned and batches is not None and batches[k] == batches[k - 1]:
            owned[-1][2].append(i)
        else:
            owned.append((b, tuple(shapes[i]), [i]))
    return table.local(rank, received), owned, int(table.numels[mine].sum()), table.local(rank, asked)


def route(
    table: MatrixTable,
    rank: int,
    shapes: Sequence[tuple[int, int]],
    pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
    transport: Transport,
) -> Route:
    """``rank``'s ``Route`` for its ``pieces`` (``(positions, writes)`` flat, host tensors): two exchanges of
    counts and positions with the stage (``transport``, collective), once."""
    host = torch.device("cpu")
    mine = requests(table, *_concatenated(pieces))
    ones = [1] * table.ranks
    counts = torch.tensor([mine.send_splits, mine.fetch_splits], dtype=torch.long, device=host).T.contiguous()
    theirs = transport(counts, ones, ones)  # [rank, (sent to me, asked of me)]
    recv_splits, serve_splits = theirs[:, 0].tolist(), theirs[:, 1].tolist()
    received = transport(mine.sent_positions, mine.send_splits, recv_splits)
    asked = transport(mine.fetch_positions, mine.fetch_splits, serve_splits)
    place, owned, owned_numel, serve = placements(table, rank, shapes, received, asked)
    sizes = [len(p) for p, _ in pieces]
    return Route(
        sizes=sizes,
        gather=Take.of(mine.gather),
        send_splits=mine.send_splits,
        recv_splits=recv_splits,
        place=Take.of(place),
        owned=owned,
        owned_numel=owned_numel,
        serve=Take.of(serve),
        serve_splits=serve_splits,
        fetch_splits=mine.fetch_splits,
        spread=[Take.of(s) for s in mine.spread.split(sizes)],
    )


def symmetric_route(
    table: MatrixTable,
    rank: int,
    shapes: Sequence[tuple[int, int]],
    pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> Route:
    """``rank``'s ``Route`` where no peer can be asked (the dry run's fake process group, whose collectives carry
    no data): its own side exact (what it sends, what it fetches, its matrices), the peers' as a symmetric world
    has them, every rank holding as many elements as this one: each owned element received once, and served
    to ``pieces' elements x ranks / stage elements`` ranks (ZeRO-0's replicas: dp x cp; ZeRO-1/2/3: one)."""
    host = torch.device("cpu")
    positions, writes = _concatenated(pieces)
    mine = requests(table, positions, writes)
    none = torch.zeros(0, dtype=torch.long, device=host)
    _, owned, owned_numel, _ = placements(table, rank, shapes, none, none)
    total = int(table.numels.sum())
    holders = max(1, round(len(positions) * table.ranks / total)) if total else 1
    sizes = [len(p) for p, _ in pieces]
    return Route(
        sizes=sizes,
        gather=Take.of(mine.gather),
        send_splits=mine.send_splits,
        recv_splits=_even(owned_numel, table.ranks),
        place=Take.of(torch.arange(owned_numel, device=host)),
        owned=owned,
        owned_numel=owned_numel,
        serve=Take.of(torch.arange(owned_numel * holders, device=host) % max(owned_numel, 1)),
        serve_splits=_even(owned_numel * holders, table.ranks),
        fetch_splits=mine.fetch_splits,
        spread=[Take.of(s) for s in mine.spread.split(sizes)],
    )


def _concatenated(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pieces' positions and writer flags, one after another (host tensors)."""
    if not pieces:
        host = torch.device("cpu")
        return torch.zeros(0, dtype=torch.long, device=host), torch.zeros(0, dtype=torch.bool, device=host)
    return torch.cat([p for p, _ in pieces]), torch.cat([w for _, w in pieces])


def _even(n: int, ranks: int) -> list[int]:
    return [n // ranks + (r < n % ranks) for r in range(ranks)]


__all__ = ["MatrixTable", "Requests", "Route", "Transport", "placements", "requests", "route", "symmetric_route"]
