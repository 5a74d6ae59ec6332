"""Asynchronous checkpoints: at a save step each rank copies what it will write to host memory (pinned on
CUDA, so the copies run asynchronously), a background thread writes and hashes the files, and the
collective finish (every rank's outcome gathered, rank 0 signs and publishes the index, ``latest`` moved last)
runs at the next step boundary. At most one save is in flight: the next save, or the finish, waits for the
writer and reports how long.

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
    """Host copies of ``tensors`` (the training step goes on changing the originals)."""
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


class AsyncCheckpointer:
    """One rank's background checkpoint writer; every rank of the job drives its own in the same order."""

    def __init__(self) -> None:
        self._save: PendingSave | None = None
        self._thread: threading.Thread | None = None

    @property
    def in_flight(self) -> int | None:
        """The step of the save being written, or None."""
        return self._save.step if self._save is not None else None

    def start(self, save: PendingSave, wrap_state=None) -> float:
        """Snapshot ``save``'s tensors to host memory and start writing them; returns the snapshot's seconds.
        ``wrap_state(state)`` may wrap the snapshot of the rank state (fault injection strikes in the writer).
        Raises ``CheckpointSaveError`` (on this rank) when host memory cannot hold the snapshot."""
        if self._save is not None:
            raise RuntimeError("a checkpoint is still in flight; finish() it first")
        need = sum(t.numel() * t.element_size() for part in (save.mine, save.mine_optim) for t in part.values())
        need += sum(t.numel() * t.element_size() for t in save.rank_state.values())
        have = host_memory_available()
        if have is not None and need > have:
            raise CheckpointSaveError(
                f"checkpoint of step {save.step} not saved: its host snapshot needs {need / 2**20:.1f} MiB and "
                f"{have / 2**20:.1f} MiB are available; use trainer.ckpt_async=false"
            )
        began = time.perf_counter()
        pin = torch.cuda.is_available()
        save.mine, save.mine_optim = _snapshot(save.mine, pin), _snapshot(save.mine_optim, pin)
        state = _snapshot(dict(save.rank_state), pin)
        save.rank_state = wrap_state(state) if wrap_state is not None else state
        if pin:
            torch.cuda.current_stream().synchronize()  # the pinned copies are complete before the writer reads
        self._save = save
        self._thread = threading.Thread(target=save.write, name=f"checkpoint-writer-{save.step}", daemon=True)
        self._thread.start()
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
