"""Optimizer state as named tensors, for safetensors checkpoints (never pickle), independent of dp and ZeRO.

Every tensor is keyed by what it is, not by who held it::

    exp_avg/<name>            plain AdamW: the whole parameter's moment, shaped like the parameter
    exp_avg/<name>[a:b]       ZeRO-1: elements a..b of the flattened parameter (1-D), held by one dp rank
    exp_avg_sq/...            the same for the second moment
    momentum_buffer/...       Muon's one momentum buffer, for the parameters Muon updates (no Adam moments)
    step/<name>, step/<name>[a:b]      0-d step count (AdamW's parameters that have been stepped)
    master/<name>[a:b]        ZeRO-1 only: the fp32 master weights of the segment

Loading assembles each parameter (or segment) from whatever pieces cover it. The same layout reloads its own
file bit-identically; a different dp size, or ZeRO on/off, reloads from the union of all dp ranks' files.
The learning rate is not state: the schedule sets it before every step.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from modelpar.optim.zero import ZeroOneAdamW

MOMENTS = ("exp_avg", "exp_avg_sq")
MUON_MOMENTS = ("momentum_buffer",)
_KEY = re.compile(r"^(exp_avg|exp_avg_sq|momentum_buffer|step|master)/(.+?)(?:\[(\d+):(\d+)\])?$")


def moment_kinds(muon: bool) -> tuple[str, ...]:
    """The state tensors shaped like a parameter that its optimizer keeps: Muon's buffer, or Adam's moments."""
    return MUON_MOMENTS if muon else MOMENTS


def switch_error(name: str, saved_muon: bool) -> ValueError:
    """One line: the checkpoint's state of ``name`` was kept by the other optimizer."""
    saved, now = ("Muon", "AdamW") if saved_muon else ("AdamW", "Muon")
    return ValueError(
        f"the checkpoint holds {saved} state for {name}, which this run updates with {now}: resume with the "
        f"optimizer that saved it (optim.name), or start from the weights only with a fresh optimizer"
    )


@dataclass(frozen=True, eq=False)
class _Piece:
    """Elements ``[start, end)`` of the flattened parameter ``name``: the tensor torch's AdamW updates."""

    name: str
    start: int
    end: int
    tensor: torch.Tensor
    whole: bool  # plain AdamW's whole parameter, saved under the bare name
    muon: bool = False  # updated by Muon: its state is a momentum buffer

    def key(self, kind: str) -> str:
        return f"{kind}/{self.name}" if self.whole else f"{kind}/{self.name}[{self.start}:{self.end}]"


def _pieces(opt: torch.optim.Optimizer | ZeroOneAdamW) -> tuple[torch.optim.Optimizer, list[_Piece], dict[str, int]]:
    """The torch optimizer holding the state, its pieces, and the element count of every parameter of this rank."""
    if isinstance(opt, ZeroOneAdamW):
        muon = getattr(opt.shard_optimizer, "muon_pieces", {})
        pieces = [_Piece(n, a, b, view, whole=False, muon=id(view) in muon) for n, a, b, view in opt.named_segments()]
        return (
            opt.shard_optimizer,
            pieces,
            {info.name: p.numel() for p, info in zip(opt.params, opt.infos, strict=True)},
        )
    pieces = []
    for group in opt.param_groups:
        if "param_names" not in group:
            raise ValueError("optimizer parameters have no names: build it with modelpar.optim.build_adamw")
        for p, name in zip(group["params"], group["param_names"], strict=True):
            pieces.append(_Piece(name, 0, p.numel(), p, whole=True, muon=bool(group.get("muon"))))
    return opt, pieces, {piece.name: piece.end for piece in pieces}


def optimizer_state_tensors(opt: torch.optim.Optimizer | ZeroOneAdamW) -> dict[str, torch.Tensor]:
    """A CPU copy of this rank's optimizer state, keyed as in the module docstring."""
    torch_opt, pieces, _ = _pieces(opt)
    tensors = {}
    for piece in pieces:
        state = torch_opt.state.get(piece.tensor)
        if state:
            for kind in (*moment_kinds(piece.muon), "step"):
                if kind in state:
                    tensors[piece.key(kind)] = state[kind]
        if not piece.whole:
            tensors[piece.key("master")] = piece.tensor
    return {key: t.detach().to("cpu", copy=True) for key, t in tensors.items()}


class _SavedPieces:
    """Saved tensors indexed by (kind, name) -> [(start, end, flat values)], whole tensors as ``[0, numel)``."""

    def __init__(self, tensors: dict[str, torch.Tensor], numels: dict[str, int]):
        self.ranges: dict[tuple[str, str], list[tuple[int, int, torch.Tensor]]] = defaultdict(list)
        for key, value in tensors.items():
            match = _KEY.match(key)
            if match is None or match[2] not in numels:
                raise KeyError(f"optimizer state key {key!r} names no parameter of this optimizer")
            kind, name = match[1], match[2]
            start, end = (int(match[3]), int(match[4])) if match[3] else (0, numels[name])
            if kind != "step" and (end > numels[name] or value.numel() != end - start):
                raise ValueError(
                    f"optimizer state {key!r} holds {value.numel()} elements, which do not fit parameter {name} "
                    f"of {numels[name]}: saved for another model shape?"
                )
            self.ranges[kind, name].append((start, end, value.reshape(-1)))

    def assemble(self, kind: str, piece: _Piece) -> torch.Tensor | None:
        """``[end - start]`` values of ``piece`` from the saved pieces; None when nothing was saved for it."""
        saved = self.ranges.get((kind, piece.name))
        if not saved:
            return None
        out = torch.empty(piece.end - piece.start, dtype=saved[0][2].dtype)
        covered = torch.zeros(piece.end - piece.start, dtype=torch.bool)
        for start, end, values in saved:
            lo, hi = max(start, piece.start), min(end, piece.end)
            if lo < hi:
                out[lo - piece.start : hi - piece.start] = values[lo - start : hi - start]
                covered[lo - piece.start : hi - piece.start] = True
        if not covered.all():
            raise ValueError(
                f"the saved {kind} of {piece.key(kind)[len(kind) + 1 :]} covers {int(covered.sum())} of its "
                f"{covered.numel()} elements: load the state files of every data-parallel rank"
            )
        return out

    def step(self, piece: _Piece) -> torch.Tensor | None:
        """The parameter's step count (every piece of a parameter steps together)."""
        steps = self.ranges.get(("step", piece.name))
        if not steps:
            return None
        if len({float(t) for _, _, t in steps}) > 1:
            raise ValueError(f"saved pieces of {piece.name} disagree on the step count: mixed checkpoints?")
        return steps[0][2].reshape(()).clone()


@torch.no_grad()
def load_optimizer_state_tensors(opt: torch.optim.Optimizer | ZeroOneAdamW, tensors: dict[str, torch.Tensor]) -> None:
    """Restore ``optimizer_state_tensors`` output; the same layout continues bit-identically.

    ``tensors`` may also be the union of several ranks' files (another dp size, ZeRO on or off): each piece
    takes the elements it covers. A parameter with no saved moments starts fresh; one whose moments are only
    partly present, or a key naming no parameter, is an error. ZeRO-1 master weights missing from ``tensors``
    (a plain AdamW checkpoint) are taken from the model; plain AdamW ignores saved master weights (its weights
    are the model's, restored from the model checkpoint).
    """
    torch_opt, pieces, numels = _pieces(opt)
    saved = _SavedPieces(tensors, numels)
    for piece in pieces:
        kinds = moment_kinds(piece.muon)
        if saved.ranges.get((moment_kinds(not piece.muon)[0], piece.name)):
            raise switch_error(piece.name, saved_muon=not piece.muon)
        moments = [saved.assemble(kind, piece) for kind in kinds]
        step = None if piece.muon else saved.step(piece)
        present = [value is not None for value in (*moments, *([] if piece.muon else [step]))]
        if not any(present):
            torch_opt.state.pop(piece.tensor, None)
            continue
        if not all(present):
            raise KeyError(f"optimizer state of {piece.name} needs {', '.join(kinds)} and step; some are missing")
        p = piece.tensor
        torch_opt.state[p] = ({} if piece.muon else {"step": step}) | {
            kind: value.to(p.device, p.dtype).view(p.shape) for kind, value in zip(kinds, moments, strict=True)
        }
    if isinstance(opt, ZeroOneAdamW):
        opt.load_master([saved.assemble("master", piece) for piece in pieces])
