"""``MuonAdamW``: torch's AdamW for some tensors and Muon for the others, as one torch optimizer.

Every data-parallel optimizer (replicated, ZeRO-1, FSDP2) builds its torch optimizer through
``modelpar.optim.adamw.make_adamw``; given a ``MuonLayout`` that builds this instead, with a third group
(``"muon": True``) of the pieces the layout covers. The AdamW groups step exactly as ``torch.optim.AdamW``
(it is that class's own ``step``); the Muon group keeps one ``momentum_buffer`` per piece, shaped like it
(whole, a ZeRO-1 segment or an FSDP2 dp shard: momentum is elementwise), and orthogonalises whole logical
matrices through ``MuonLayout.orthogonalise`` (collective over the pipeline stage's ranks), by the route
``MuonLayout.route`` planned once for this optimizer's pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from modelpar.optim.muon import momentum_update
from modelpar.optim.muon_layout import MuonLayout
from modelpar.parallel.dtensors import local_tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


class MuonAdamW(torch.optim.AdamW):
    """AdamW over the groups without ``"muon"``, Muon over the group with it (see the module docstring).

    ``muon_pieces[id(tensor)]``: ``muon_piece``'s ``(positions, writes, ratio)`` of each tensor of the Muon
    group."""

    def __init__(
        self,
        groups: list[dict],
        *,
        layout: MuonLayout,
        muon_pieces: dict[int, tuple],
        **adamw,
    ):
        super().__init__(groups, **adamw)
        self.layout = layout
        self.muon_pieces = muon_pieces
        muon = [p for g in self.param_groups if g.get("muon") for p in g["params"]]
        device = _local(muon[0]).device if muon else torch.device("cpu")
        self.route = layout.route([muon_pieces[id(p)][:2] for p in muon], device)  # collective over the stage
        # the route holds what the steps need: drop the pieces' position maps, keep their learning-rate ratios
        self.muon_pieces = {key: (None, None, ratio) for key, (_, _, ratio) in muon_pieces.items()}

    @torch.no_grad()
    def step(self, closure=None):
        everything = self.param_groups
        try:  # AdamW's own step over its groups only
            self.param_groups = [g for g in everything if not g.get("muon")]
            loss = super().step(closure)
        finally:
            self.param_groups = everything
        for group in everything:
            if group.get("muon"):
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        settings = self.layout.settings
        params: Sequence[torch.Tensor] = group["params"]
        sizes = self.route.sizes
        device = _local(params[0]).device if params else torch.device("cpu")
        # the pieces' momentum updates written straight into the one flat buffer the exchange sends from
        values = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        for p, piece in zip(params, values.split(sizes), strict=True):
            if p.grad is None:
                piece.zero_()
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad = _local(p.grad)
            momentum_update(grad, _local(state["momentum_buffer"]), settings, out=piece.view(grad.shape))
        back = self.layout.orthogonalise(self.route, values)
        lr, decay = group["lr"], group["weight_decay"]
        for p, spread in zip(params, self.route.spread, strict=True):
            if p.grad is None:
                continue
            weights = _local(p).view(-1)
            ratio = self.muon_pieces[id(p)][2]
            weights.mul_(1 - lr * decay)
            for at, out in spread.segments(back):  # views of what came back where it runs whole
                part = weights[at : at + out.numel()]
                if isinstance(ratio, float):  # as torch.optim.Muon: one alpha for the whole tensor
                    part.add_(out, alpha=-(lr * ratio))
                else:  # a piece fusing matrices whose shapes adjust the learning rate differently
                    part.add_(out * (-lr * ratio[at : at + out.numel()]).to(torch.float32))


def muon_piece(layout: MuonLayout, param: torch.Tensor, rows: slice | None = None, flat: slice | None = None):
    """``(positions, writes, ratio)`` of a piece of ``param``: all of it, its dp-shard ``rows``, or the ``flat``
    range of its elements (a ZeRO-1 segment), flat, on the host; ``ratio``: the learning-rate factor of its
    matrices, a float when one for all (else one per element, float64, on the piece's device)."""
    pos, write = layout.positions[id(param)], layout.writes[id(param)]
    if rows is not None:
        pos, write = pos[rows], write[rows]
    pos, write = pos.reshape(-1), write.reshape(-1)
    if flat is not None:
        pos, write = pos[flat], write[flat]
    device = _local(param).device
    ratios = layout.ratios_at(pos)
    ratio = float(ratios[0]) if ratios.numel() and bool((ratios == ratios[0]).all()) else ratios.to(device)
    return pos, write, ratio


__all__ = ["MuonAdamW", "muon_piece"]
