"""Asynchronous checkpoints: at a save step each rank captures its small rank state (RNG, sampler, step) at
once and hands the rest to a background thread, which first copies the weights and optimizer moments into
host staging buffers (pinned on CUDA, on a side stream; kept from one save to the next, so only the first save
allocates them), then hashes and writes the files. The copy overlaps the next step's forward and backward,
which only read those tensors; the step's optimizer update waits for it first (``wait_snapshot``, the fence).
The collective finish (every rank's outcome gathered, rank 0 signs and publishes the index, ``latest`` moved
last) runs at the next save or at the end. At most one save is in flight: the next save, or the finish, waits
for the writer and reports how long.

A rank killed while its writer runs leaves the temporary directory unpublished: ``latest`` still names the
last complete checkpoint, and the next save (or a resume) removes the leftovers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from modelpar.checkpoint.save import CheckpointSaveError, PendingSave
from modelpar.checkpoint.store import this_rank


def host_memory_available() -> int | None:
    """Bytes of memory the kernel says can be had without swapping (``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _snapshot(tensors: Mapping, pin: bool) -> dict:
    """Host copies of ``tensors``, made now (the small rank state)."""
    out = {}
    for key, t in tensors.items():
        t = t.detach()
        if t.device.type == "cpu":
            out[key] = t.clone()
        else:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            out[key] = host
    return out


def _nbytes(tensors: Mapping) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AsyncCheckpointer:
    """One rank's background checkpoint writer; every rank of the job drives its own in the same order."""

    def __init__(self) -> None:
        self._save: PendingSave | None = None
        self._thread: threading.Thread | None = None
        self._staging: dict = {}  # (part, piece) -> host buffer, reused by the next save of the same shapes
        self._copied = threading.Event()
        self._copied.set()

    @property
    def in_flight(self) -> int | None:
        """The step of the save being written, or None."""
        return self._save.step if self._save is not None else None

    @property
    def staged_bytes(self) -> int:
        """Host memory held by the staging buffers."""
        return _nbytes(self._staging)

    def _unstaged_bytes(self, part: str, tensors: Mapping) -> int:
        """Bytes of ``tensors`` with no staging buffer of their shape yet."""
        need = 0
        for key, t in tensors.items():
            have = self._staging.get((part, key))
            if have is None or have.shape != t.shape or have.dtype != t.dtype:
                need += t.numel() * t.element_size()
        return need

    def start(self, save: PendingSave, wrap_state=None) -> float:
        """Snapshot ``save``'s rank state and start the writer, which stages the weights and moments first;
        returns this call's seconds. ``wrap_state(state)`` may wrap the rank state (fault injection strikes in
        the writer). Until ``wait_snapshot`` returns, nothing may change the tensors of ``save``. Raises
        ``CheckpointSaveError`` (on this rank) when host memory cannot hold the staging buffers."""
        if self._save is not None:
            raise RuntimeError("a checkpoint is still in flight; finish() it first")
        need = self._unstaged_bytes("model", save.mine) + self._unstaged_bytes("optim", save.mine_optim)
        need += _nbytes(save.rank_state)
        have = host_memory_available()
        if have is not None and need > have:
            raise CheckpointSaveError(
                f"checkpoint of step {save.step} not saved: its host snapshot needs {need / 2**20:.1f} MiB and "
                f"{have / 2**20:.1f} MiB are available; use trainer.ckpt_async=false"
            )
        began = time.perf_counter()
        pin = torch.cuda.is_available()
        state = _snapshot(dict(save.rank_state), pin)
        if pin:
            torch.cuda.current_stream().synchronize()  # the rank state's copies are complete
        save.rank_state = wrap_state(state) if wrap_state is not None else state
        ready = None
        device = next((t.device for part in (save.mine, save.mine_optim) for t in part.values() if t.is_cuda), None)
        if device is not None:
            ready = torch.cuda.Event()
            ready.record()  # the side stream's copies start after what the step has queued
        self._save = save
        self._copied.clear()
        self._thread = threading.Thread(
            target=self._stage_then_write,
            args=(save, device, ready, pin),
            name=f"checkpoint-writer-{save.step}",
            daemon=True,
        )
        self._thread.start()
        return time.perf_counter() - began

    def _stage(self, part: str, tensors: Mapping, pin: bool, stream) -> dict:
        out = {}
        for key, t in tensors.items():
            t = t.detach()
            buf = self._staging.get((part, key))
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.is_cuda)
                self._staging[(part, key)] = buf
            if t.is_cuda:
                with torch.cuda.stream(stream):
                    buf.copy_(t, non_blocking=pin)
            else:
                buf.copy_(t)
            out[key] = buf
        return out

    def _stage_then_write(self, save: PendingSave, device, ready, pin: bool) -> None:
        """The writer thread: copy into the staging buffers (then release the fence), hash and write."""
        try:
            stream = None
            if device is not None:
                torch.cuda.set_device(device)  # this thread's current device: the rank's
                stream = torch.cuda.Stream()
                stream.wait_event(ready)
            save.mine = self._stage("model", save.mine, pin, stream)
            save.mine_optim = self._stage("optim", save.mine_optim, pin, stream)
            if stream is not None:
                stream.synchronize()
        except RuntimeError as exc:  # allocation of a staging buffer, a device error: the save fails alone
            save.error = f"rank {this_rank()}: host snapshot failed: {exc}"
            return
        finally:
            self._copied.set()
        save.write()

    def wait_snapshot(self) -> float:
        """The fence: block until the writer has copied the weights and moments (before anything changes
        them, e.g. the optimizer update); returns the seconds waited."""
        if self._copied.is_set():
            return 0.0
        began = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - began

    def wait(self) -> float:
        """Block until the writer is done; returns the seconds waited (0 when nothing is in flight)."""
        if self._thread is None:
            return 0.0
        began = time.perf_counter()
        self._thread.join()
        self._thread = None
        return time.perf_counter() - began

    def finish(self) -> tuple[Path | None, float]:
        """Collective: wait for the writer, then publish (or raise the same ``CheckpointSaveError`` on every
        rank). Returns the checkpoint directory (None when nothing was in flight) and the seconds waited."""
        if self._save is None:
            return None, 0.0
        waited = self.wait()
        save, self._save = self._save, None
        return save.finish(), waited
