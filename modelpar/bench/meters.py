"""Memory on CPU, where no allocator keeps a peak: the bytes autograd holds for backward, and the model states.

meter = SavedTensorMeter(exclude=parameters)
with meter:
    loss = step(batch)         # every tensor autograd saves is counted while it is held
loss.backward()                # ... and uncounted as autograd lets it go
meter.peak                     # most bytes held at once (on the device)
meter.host_peak                # most bytes offload held in host memory at once

trainer_state_bytes(trainer)   # weights, gradients, optimizer state, gradient buffers of this rank
GatheredMeter(chunks)          # FSDP2's gathered weights and unsharded gradients, sampled as the step runs
"""

from __future__ import annotations

import weakref

import torch

from modelpar.model.activations import watch


class SavedTensorMeter:
    """Bytes held by tensors autograd saved for backward, live and at peak, counted once per storage.

    Inside ``with meter:`` every saved tensor is packed into a holder that keeps it alive exactly as long as
    autograd would (the graph owns the holder); the holder adds its storage's bytes when the first holder of
    that storage is made and subtracts them when the last one dies. Parameters (``exclude``) are not
    activations and are skipped. ``shapes`` maps (shape, dtype) of each newly held storage's first saved view
    to (count, storage bytes), for a breakdown.

    Two kinds of kept tensors escape an outer saved-tensor hook, and the meter is shown them instead
    (``modelpar.model.activations.watch``): under ``parallel.offload_activations`` the blocks' own hooks take
    over, and tell the meter which tensors stay on the device (counted here) and which host copies they made
    (``host_live`` / ``host_peak``); under selective checkpointing (``elementwise``) PyTorch caches the kept
    matmul and attention outputs itself, and those count from the forward until their storage is freed.
    Recomputed tensors, which exist only while a rerun block's backward runs, are not counted (nothing but the
    rerun holds them). ``gathered``, if given (a ``GatheredMeter``), is sampled at every pack and unpack, and
    the weights it holds gathered (FSDP2's unsharded parameters, saved by the matmuls) are not activations.
    """

    def __init__(self, exclude: list[torch.Tensor] = (), gathered: GatheredMeter | None = None):
        self.excluded = {_storage_key(t) for t in exclude}
        self.live = 0
        self.peak = 0
        self.host_live = 0
        self.host_peak = 0
        self.gathered = gathered
        self._refs: dict[tuple, int] = {}
        self.shapes: dict[tuple[tuple[int, ...], str], tuple[int, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._watch = None

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        self._watch = watch(self)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._watch.__exit__(*exc)
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        if self.gathered is not None:
            self.gathered.sample()
        key = _storage_key(tensor)
        if key in self.excluded or isinstance(tensor, torch.nn.Parameter):
            return tensor
        if self.gathered is not None and self.gathered.holds(key):
            return tensor
        self._hold(key, tensor)
        # detached: a saved *output* would otherwise point back at its own grad_fn through this holder, a
        # cycle through autograd's C++ graph that keeps nodes retained by retain_graph=True (zero-bubble's B)
        # alive until the step ends, and the meter would report bytes autograd itself has already let go
        return _Saved(self, key, tensor.detach())

    def _unpack(self, packed):
        if self.gathered is not None:
            self.gathered.sample()
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _hold(self, key: tuple, tensor: torch.Tensor) -> None:
        count = self._refs.get(key, 0)
        if count == 0:
            self.live += key[2]
            self.peak = max(self.peak, self.live)
            sig = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            seen, nbytes = self.shapes.get(sig, (0, 0))
            self.shapes[sig] = (seen + 1, nbytes + key[2])
        self._refs[key] = count + 1

    def _release(self, key: tuple) -> None:
        count = self._refs[key] - 1
        if count:
            self._refs[key] = count
        else:
            del self._refs[key]
            self.live -= key[2]

    # -- what ``modelpar.model.activations`` shows the meter (see ``watch``) ---------------------------------

    def keep(self, tensor: torch.Tensor):
        """Offload left ``tensor`` on the device: counted like a saved tensor."""
        return self._pack(tensor)

    def offloaded(self, host: torch.Tensor) -> _HostSaved:
        """Offload's host copy of a saved tensor, held until backward has read it back."""
        self.host_live += host.untyped_storage().nbytes()
        self.host_peak = max(self.host_peak, self.host_live)
        return _HostSaved(self, host)

    def cached(self, tensor: torch.Tensor) -> None:
        """An output selective checkpointing keeps: counted until its storage is freed."""
        key = _storage_key(tensor)
        if key in self.excluded:
            return
        self._hold(key, tensor)
        weakref.finalize(tensor.untyped_storage(), self._release, key)


class _Saved:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: tuple, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class _HostSaved:
    __slots__ = ("meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor):
        self.meter, self.tensor = meter, tensor

    def __del__(self) -> None:
        self.meter.host_live -= self.tensor.untyped_storage().nbytes()


def _storage_key(t: torch.Tensor) -> tuple:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2's sharded parameter): its local shard
    storage = t.untyped_storage()
    # a meta storage has no address (data_ptr 0 for all): its StorageImpl's identity tells them apart
    address = storage._cdata if t.device.type == "meta" else storage.data_ptr()
    return (t.device.type, address, storage.nbytes())


def _nbytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def model_state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of weights, gradients and optimizer state (its dp shard of each under ZeRO-2/3;
    ZeRO-1's sharded state lives in its own optimizer, whose ``state`` this reads the same way)."""
    state = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {
        "weights": sum(_nbytes(p) for p in params),
        "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_nbytes(v) for v in state if v.dim() > 0),  # AdamW's moments (its step count aside)
    }


def trainer_state_bytes(trainer) -> dict[str, int]:
    """What this rank of ``trainer`` holds besides activations, by kind; call with the step's gradients ready
    (the optimizer's step pre-hook, ``StateProbe``):

    - ``weights``: the parameters (their dp shard under ZeRO-2/3);
    - ``gradients``: ``param.grad`` (sharded under ZeRO-2/3) plus ZeRO-1's reduced gradient shard;
    - ``optimizer``: AdamW's two moments, and ZeRO-1's fp32 master shard;
    - ``buffers``: what zero-0's all-reduce buckets hold besides the gradients living in them (a has-gradient
      flag per parameter, and the space of a parameter with no gradient this step)."""
    params = [p for p, _ in trainer.model.params]
    outer = trainer.optimizer
    inner = outer.optimizer
    zero_one = getattr(inner, "shard_optimizer", None)
    out = model_state_bytes(params, zero_one or inner)
    out["buffers"] = 0
    if zero_one is not None:  # ZeroOneAdamW: moments keyed by views of the master shard
        for part in inner.partitions:
            out["optimizer"] += _nbytes(part.master)
        out["gradients"] += sum(_nbytes(s) for s in getattr(inner, "_shards", []))
    for sync in getattr(outer, "syncs", []):
        for bucket in sync.buckets:
            in_use = sum(_nbytes(v) for p, v in zip(bucket.params, bucket.views, strict=True) if p.grad is v)
            out["buffers"] += _nbytes(bucket.flat) - in_use
    return out


class StateProbe:
    """``trainer_state_bytes`` at the optimizer step of the next ``train_one`` (a step pre-hook on the torch
    optimizer that steps): ``probe.bytes`` after the step, None if no step ran."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.bytes: dict[str, int] | None = None
        inner = trainer.optimizer.optimizer
        stepping = getattr(inner, "shard_optimizer", inner)
        self._handle = stepping.register_step_pre_hook(self._seen)

    def _seen(self, *_) -> None:
        self.bytes = trainer_state_bytes(self.trainer)

    def remove(self) -> None:
        self._handle.remove()


class GatheredMeter:
    """FSDP2's (ZeRO-2/3) unsharded weights and unsharded gradients on this rank, sampled: ``sample()`` (the
    ``SavedTensorMeter``'s hook, which runs at every saved-tensor pack and unpack, so many times per block
    forward and backward) adds up the storages allocated at that instant; ``peak_weights`` and
    ``peak_gradients`` are the largest sums seen, ``peak`` that of both. Nothing under ZeRO 0-1."""

    def __init__(self, chunks: list[torch.nn.Module]):
        self.params, self.groups = [], []
        for chunk in chunks:
            for module in chunk.modules():
                state = getattr(module, "_get_fsdp_state", None)
                group = state()._fsdp_param_group if state is not None else None
                if group is not None:
                    self.groups.append(group)
                    self.params += group.fsdp_params
        self.peak_weights = self.peak_gradients = self.peak = 0

        self._live: set[tuple] = set()

    def __bool__(self) -> bool:
        return bool(self.params)

    def holds(self, key: tuple) -> bool:
        """Whether the storage of ``key`` (``_storage_key``) is a gathered weight at the last sample."""
        return key in self._live

    def sample(self) -> None:
        weights = grads = 0
        self._live = set()
        for fp in self.params:
            for t in fp.all_gather_outputs:
                if t.untyped_storage().nbytes():
                    weights += t.untyped_storage().nbytes()
                    self._live.add(_storage_key(t))
        # a group's flat all-gather buffer, from the (prefetched) gather until its copy-out into the parameters
        results = [g._all_gather_result for g in self.groups]
        if self.groups and self.groups[0].comm_ctx.all_gather_state is not None:
            results.append(self.groups[0].comm_ctx.all_gather_state.all_gather_result)
        flat = {_storage_key(r.all_gather_output) for r in results if r is not None}
        weights += sum(key[2] for key in flat - self._live)
        for fp in self.params:
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                grads += _nbytes(unsharded.grad)
            if fp.unsharded_accumulated_grad is not None:
                grads += _nbytes(fp.unsharded_accumulated_grad)
        self.peak_weights = max(self.peak_weights, weights)
        self.peak_gradients = max(self.peak_gradients, grads)
        self.peak = max(self.peak, weights + grads)
