"""What a block keeps for its backward: recompute policies and activation offload.

``parallel.recompute``:

    none        every op keeps what it saves for backward
    full        each block keeps only its input; backward reruns the whole block (collectives included)
    selective   ``parallel.recompute_modules`` names what is rerun instead of kept:
                  attention    the attention half (norm, qkv, RoPE, attention, output projection) keeps only its
                               input and is rerun in backward
                  mlp          the MLP half (norm, gate|up, SwiGLU, down) likewise
                  elementwise  in the halves not rerun whole, matmul and attention outputs are kept and every
                               other op (norms, RoPE, SwiGLU's product, residual adds) is rerun: memory of the
                               cheap ops for almost no FLOPs (PyTorch's selective activation checkpoint, with a
                               save list as torchtitan's op policy)

Recomputation reruns tensor-parallel collectives inside the rerun region in backward, in the same order on
every tp rank, as full recompute does. Gradients are bit-identical to no recompute on one device.

``parallel.offload_activations=true`` moves what autograd saves in the blocks to host memory (pinned, with
non-blocking copies on CUDA) and back when backward needs it, through ``torch.autograd.graph`` saved-tensor
hooks; parameters and tensors under 16 KiB stay where they are. On a CPU run there is no other memory to move
to: the tensors are copied into separate host buffers all the same, so the path is exercised and counted
(``ActivationOffload.bytes_offloaded``), with no saving.

Tensors kept out of sight of an outer saved-tensor hook (a memory meter's, ``modelpar.bench.meters``) are shown
to the meters registered with ``watch``: what offload leaves on the device (``keep``) or moves (``offloaded``),
and the outputs selective checkpointing caches itself (``cached``), which no hook ever sees.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.utils.checkpoint as _checkpoint
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from modelpar.parallel import kept

RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("attention", "mlp", "elementwise")
DEFAULT_SELECTIVE = ("elementwise",)

_aten = torch.ops.aten
# ops whose outputs ``elementwise`` keeps: the expensive ones (matmuls, attention kernels)
SAVED_OPS = frozenset(
    op
    for name, overload in (
        ("mm", "default"),
        ("addmm", "default"),
        ("bmm", "default"),
        ("baddbmm", "default"),
        ("_scaled_dot_product_flash_attention", "default"),
        ("_scaled_dot_product_flash_attention_for_cpu", "default"),
        ("_scaled_dot_product_efficient_attention", "default"),
        ("_scaled_dot_product_cudnn_attention", "default"),
        ("_flash_attention_forward", "default"),
        ("_efficient_attention_forward", "default"),
    )
    if (op := getattr(getattr(_aten, name, None), overload, None)) is not None
)


# meters (``modelpar.bench.meters.SavedTensorMeter``) watching what the hooks below keep; empty outside one
_WATCHERS: list = kept.WATCHERS  # one list: context parallelism's kept results report to the same meters


@contextlib.contextmanager
def watch(watcher) -> Iterator[None]:
    """Show ``watcher`` what offload and selective checkpointing keep while the block is inside: it needs
    ``keep(t) -> packed`` and ``unpack(packed)`` (a tensor left on the device, held until backward lets it go),
    ``offloaded(host) -> packed`` (the host copy of one moved) and ``cached(t)`` (an output selective
    checkpointing caches, held until its storage is freed)."""
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.remove(watcher)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op not in SAVED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if _WATCHERS:
        outputs = ctx.op_output if isinstance(ctx.op_output, tuple | list) else (ctx.op_output,)
        for t in outputs:
            if isinstance(t, torch.Tensor):
                _WATCHERS[-1].cached(t)
    return CheckpointPolicy.MUST_SAVE


class _KeptEntries(dict):
    """One op's cached outputs, by call index, that a backward reads without consuming."""

    def __setitem__(self, key, value) -> None:
        if value is not _checkpoint._CONSUMED:
            super().__setitem__(key, value)


def _replayable_selective_contexts():
    """``create_selective_checkpoint_contexts(_keep_matmuls)`` whose cache a second backward through the region
    may read again. A zero-bubble schedule's backward is two autograd passes over one graph (B for the input
    gradient, then W for the weights: ``modelpar.pipeline.split_backward``), and each reruns the region; torch's
    cache marks an output consumed at its first read and refuses the second. Kept, the cached outputs live as
    long as the region's graph (until W), instead of being dropped one by one during the first pass."""
    caching, cached = create_selective_checkpoint_contexts(_keep_matmuls)
    storage = collections.defaultdict(_KeptEntries)
    caching.storage = cached.storage = storage
    return caching, cached


class RecomputePolicy:
    """How a block runs its halves under ``mode`` (none | selective | full) and ``modules``."""

    def __init__(self, mode: str = "none", modules: Iterable[str] = ()):
        if mode not in RECOMPUTE:
            raise ValueError(f"recompute={mode!r} must be one of {RECOMPUTE}")
        modules = tuple(modules) if mode == "selective" else ()
        unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
        if unknown:
            raise ValueError(f"recompute_modules: unknown {unknown}; choose from {list(RECOMPUTE_MODULES)}")
        if mode == "selective" and not modules:
            raise ValueError(f"recompute=selective needs recompute_modules, some of {list(RECOMPUTE_MODULES)}")
        self.mode, self.modules = mode, frozenset(modules)

    def __repr__(self) -> str:
        return f"RecomputePolicy({self.mode!r}, {sorted(self.modules)})"

    def reruns(self, name: str) -> bool:
        """Whether backward reruns the forward of block half ``name`` (attention | mlp): the whole half, or
        its element-wise ops under ``elementwise`` (which rerun its sequence-parallel all-gathers too)."""
        if self.mode == "full":
            return True
        return self.mode == "selective" and (name in self.modules or "elementwise" in self.modules)

    def run_half(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``fn(x)`` for the block half ``name`` (attention | mlp), rerun in backward as the policy says."""
        if self.mode != "selective" or not torch.is_grad_enabled():
            return fn(x)
        if name in self.modules:
            return checkpoint(fn, x, use_reentrant=False)
        if "elementwise" in self.modules:
            return checkpoint(fn, x, use_reentrant=False, context_fn=_replayable_selective_contexts)
        return fn(x)


class ActivationOffload:
    """Saved-tensor hooks that keep saved activations in host memory until backward (see the module doc).

    ``exclude``: tensors never moved (the parameters); tensors under ``min_bytes`` stay too (their copies
    would cost more than they free). ``bytes_offloaded`` / ``tensors_offloaded`` count what was moved since the
    last ``reset()``.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), min_bytes: int = 16 * 1024):
        self._excluded = {_storage_key(t) for t in exclude}
        self.min_bytes = min_bytes
        self.bytes_offloaded = 0
        self.tensors_offloaded = 0

    def reset(self) -> None:
        self.bytes_offloaded = self.tensors_offloaded = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        size = t.numel() * t.element_size()
        small = t.untyped_storage().nbytes() < self.min_bytes  # a view of a large buffer is worth moving
        if isinstance(t, torch.nn.Parameter) or small or _storage_key(t) in self._excluded:
            return _Kept(_WATCHERS[-1].keep(t)) if _WATCHERS else t
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
            host.copy_(t, non_blocking=True)
        else:
            host = t.detach().clone()
        self.bytes_offloaded += size
        self.tensors_offloaded += 1
        return (t.device, _WATCHERS[-1].offloaded(host) if _WATCHERS else host)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Kept):
            return packed.watcher_unpack()
        device, host = packed
        if not isinstance(host, torch.Tensor):  # a watcher's holder of the host copy
            host = host.tensor
        return host.to(device, non_blocking=True) if device.type == "cuda" else host


class _Kept:
    """A tensor offload leaves on the device, packed by the watcher that counts it."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed

    def watcher_unpack(self) -> torch.Tensor:
        return self.packed.tensor if not isinstance(self.packed, torch.Tensor) else self.packed


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr())


__all__ = [
    "DEFAULT_SELECTIVE",
    "RECOMPUTE",
    "RECOMPUTE_MODULES",
    "SAVED_OPS",
    "ActivationOffload",
    "RecomputePolicy",
    "watch",
]
