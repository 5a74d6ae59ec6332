"""Activation memory on CPU, where no allocator keeps a peak: the bytes autograd holds for backward.

meter = SavedTensorMeter(exclude=parameters)
with meter:
    loss = step(batch)         # every tensor autograd saves is counted while it is held
loss.backward()                # ... and uncounted as autograd lets it go
meter.peak                     # most bytes held at once
"""

from __future__ import annotations

import torch


class SavedTensorMeter:
    """Bytes held by tensors autograd saved for backward, live and at peak, counted once per storage.

    Inside ``with meter:`` every saved tensor is packed into a holder that keeps it alive exactly as long as
    autograd would (the graph owns the holder); the holder adds its storage's bytes when the first holder of
    that storage is made and subtracts them when the last one dies. Parameters (``exclude``) are not
    activations and are skipped. ``shapes`` maps (shape, dtype) of each newly held storage's first saved view
    to (count, storage bytes), for a breakdown.
    """

    def __init__(self, exclude: list[torch.Tensor] = ()):
        self.excluded = {_storage_key(t) for t in exclude}
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple, int] = {}
        self.shapes: dict[tuple[tuple[int, ...], str], tuple[int, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key in self.excluded or isinstance(tensor, torch.nn.Parameter):
            return tensor
        count = self._refs.get(key, 0)
        if count == 0:
            self.live += key[2]
            self.peak = max(self.peak, self.live)
            sig = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            seen, nbytes = self.shapes.get(sig, (0, 0))
            self.shapes[sig] = (seen + 1, nbytes + key[2])
        self._refs[key] = count + 1
        # detached: a saved *output* would otherwise point back at its own grad_fn through this holder, a
        # cycle through autograd's C++ graph that keeps nodes retained by retain_graph=True (zero-bubble's B)
        # alive until the step ends, and the meter would report bytes autograd itself has already let go
        return _Saved(self, key, tensor.detach())

    def _release(self, key: tuple) -> None:
        count = self._refs[key] - 1
        if count:
            self._refs[key] = count
        else:
            del self._refs[key]
            self.live -= key[2]


class _Saved:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: tuple, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, storage.data_ptr(), storage.nbytes())


def model_state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of weights, gradients and optimizer state (its dp shard of each under ZeRO-2/3;
    ZeRO-1's sharded state lives in its own optimizer, whose ``state`` this reads the same way)."""

    def nbytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    state = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {
        "weights": sum(nbytes(p) for p in params),
        "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(nbytes(v) for v in state if v.dim() > 0),  # AdamW's moments (its step count aside)
    }
