"""Count the calls that make the host wait for the device, and say where each one was made.

    with count_host_syncs() as syncs:
        step(batch)
    assert syncs.count <= 1, syncs.report()

A GPU step should wait for the device at most once outside logging. Reading a tensor's value on the host waits
for every kernel queued before it: ``item``, ``tolist``,
``float(t)``, ``int(t)``, ``bool(t)`` (an ``if`` on a tensor), ``t.__index__`` (a tensor used as an index or a
``range`` bound), and copying a device tensor to the CPU with ``cpu()``, ``to("cpu")`` or ``numpy(force=True)``
(``to("cpu", non_blocking=True)`` does not wait, and is not counted).

On CPU nothing waits, so this counts the *calls* that would wait on a GPU: for the duration of the block those
methods of ``torch.Tensor`` are wrapped (and put back afterwards), and each call is recorded with the first
stack frame outside torch, the line a reader would change. A CPU tensor's ``item`` is a sync only in this
sense; on a GPU run pass ``include_cpu=False`` so that host-resident scalars (the optimizer's step counters,
say) are left out. A call made by torch on the caller's behalf (``optimizer.step()`` reading its step counter)
is named by the caller's line, with the torch line beside it as ``via``.

What it cannot see: syncs inside torch's C++ (a boolean-mask index, ``nonzero``, ``torch.unique``, a blocking
copy that a kernel issues) and anything inside a ``torch.compile`` graph, whose method calls are traced, not
made. For those, on CUDA, ``cuda_sync_debug="warn"`` (or ``"error"``) also sets
``torch.cuda.set_sync_debug_mode`` for the block: every synchronising CUDA call then warns (or raises) with its
own stack; the previous mode is restored on exit. It is ignored without CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

# Methods that read the value on the host whatever the tensor's device ...
_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
# ... and copies that wait only when the tensor is not already on the CPU.
_COPIES = ("cpu", "numpy", "to")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)


@dataclass(frozen=True)
class HostSync:
    """One call that waits for the device: ``method`` on a tensor on ``device``, made at ``site``.

    ``site`` is ``file:line`` of the first frame outside torch; ``via`` is the torch frame that made the call on
    the site's behalf (None when the site called the method itself).
    """

    method: str
    device: str
    site: str
    via: str | None = None

    def __str__(self) -> str:
        via = f" (via {self.via})" if self.via else ""
        return f"{self.site}: Tensor.{self.method} on {self.device}{via}"


@dataclass
class HostSyncLog:
    """The host syncs recorded inside one ``count_host_syncs()`` block, in call order."""

    include_cpu: bool = True
    syncs: list[HostSync] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.syncs)

    def by_site(self) -> Counter[str]:
        """How many syncs each call site made."""
        return Counter(str(s) for s in self.syncs)

    def report(self) -> str:
        """One line per call site, most frequent first: ``3x path/file.py:12: Tensor.item on cpu``."""
        lines = [f"{n}x {site}" for site, n in self.by_site().most_common()]
        return f"{self.count} host sync(s)" + "".join(f"\n  {line}" for line in lines)


_active: list[HostSyncLog] = []
_saved: dict[str, object] = {}  # method name -> what torch.Tensor.__dict__ held (absent: inherited from C)
_patch_lock = threading.Lock()
_inside = threading.local()  # set while a wrapped method runs: what it calls in turn is not counted again


def _short(path: str) -> str:
    if path.startswith(_TORCH_DIR):
        return "torch/" + path[len(_TORCH_DIR) :]
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def _call_site() -> tuple[str, str | None]:
    """(first frame outside torch and this module, innermost torch frame if torch made the call)."""
    frame = sys._getframe(2)  # skip _call_site and the wrapper
    via = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_TORCH_DIR):
            via = via or f"{_short(path)}:{frame.f_lineno}"
        elif os.path.abspath(path) != _THIS_FILE:
            return f"{_short(path)}:{frame.f_lineno}", via
        frame = frame.f_back
    return "<unknown>", via


def _waits_for_copy(out, kwargs: dict) -> bool:
    """Whether a device tensor's ``cpu`` / ``numpy`` / ``to`` call that returned ``out`` waited for the device."""
    if kwargs.get("non_blocking"):
        return False
    return not torch.is_tensor(out) or out.device.type == "cpu"  # numpy() returns an array


def _wrap(name: str, original: Callable) -> Callable:
    copies = name in _COPIES

    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        if getattr(_inside, "active", False):
            return original(self, *args, **kwargs)
        _inside.active = True
        try:
            out = original(self, *args, **kwargs)
        finally:
            _inside.active = False
        device = self.device
        if copies and (device.type == "cpu" or not _waits_for_copy(out, kwargs)):
            return out
        logs = [log for log in _active if log.include_cpu or device.type != "cpu"]
        if logs:
            sync = HostSync(name, str(device), *_call_site())
            for log in logs:
                log.syncs.append(sync)
        return out

    return counted


def _patch() -> None:
    for name in _READS + _COPIES:
        if name in torch.Tensor.__dict__:
            _saved[name] = torch.Tensor.__dict__[name]
        setattr(torch.Tensor, name, _wrap(name, getattr(torch.Tensor, name)))


def _unpatch() -> None:
    for name in _READS + _COPIES:
        if name in _saved:
            setattr(torch.Tensor, name, _saved.pop(name))
        else:
            delattr(torch.Tensor, name)  # back to the C method inherited from TensorBase


@contextlib.contextmanager
def count_host_syncs(*, include_cpu: bool = True, cuda_sync_debug: str | None = None) -> Iterator[HostSyncLog]:
    """Record every host-sync call on a tensor made while the block runs (any thread); nests.

    ``include_cpu=False`` leaves out calls on CPU tensors (they wait for nothing on a GPU run).
    ``cuda_sync_debug``: "warn" or "error" to also set ``torch.cuda.set_sync_debug_mode`` for the block (CUDA only).
    """
    if cuda_sync_debug not in (None, "warn", "error"):
        raise ValueError(f"cuda_sync_debug={cuda_sync_debug!r} must be None, 'warn' or 'error'")
    log = HostSyncLog(include_cpu=include_cpu)
    with _patch_lock:
        if not _active:
            _patch()
        _active.append(log)
    debug = cuda_sync_debug is not None and torch.cuda.is_available()
    previous_mode = torch.cuda.get_sync_debug_mode() if debug else 0
    if debug:
        torch.cuda.set_sync_debug_mode(cuda_sync_debug)
    try:
        yield log
    finally:
        if debug:
            torch.cuda.set_sync_debug_mode(previous_mode)
        with _patch_lock:
            _active.remove(log)
            if not _active:
                _unpatch()
