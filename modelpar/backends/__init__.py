"""Transport backends: what one transport needs that the engine must not see.

The engine (model, pipeline, optim) talks through ``modelpar.parallel.collectives`` only. A CPU job on gloo is
tuned by ``gloo_cpu`` (exchange collectives, core binding, socket-thread priority); NCCL needs nothing here. A CPU
rank's FP8 GEMMs go through ``cpu_fp8`` (torch's CPU kernel for per-tensor scales is a slow reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelpar.backends import cpu_fp8, gloo_cpu
from modelpar.model.layers.fp8 import install_gemm
from modelpar.parallel.collectives import install_algorithm
from modelpar.parallel.groups import ParallelGroups


@dataclass
class NoTuning:
    idle_threads: tuple[int, ...] = ()

    def close(self) -> None:
        pass


def uses_gloo(device: torch.device) -> bool:
    """Whether this rank talks to others over gloo (CPU ranks of a multi-rank job)."""
    return device.type == "cpu" and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo"


def install(groups: ParallelGroups, device: torch.device, *, collectives: str = "auto", gloo_threads: str = "normal"):
    """Tune this rank for its transport and device; returns a handle whose ``close()`` undoes what can be undone."""
    install_gemm(cpu_fp8.scaled_mm if device.type == "cpu" else None)  # FP8's per-tensor scales on CPU
    if uses_gloo(device):
        return gloo_cpu.install(collectives, gloo_threads, groups.tp_group, groups.layout.tp)
    if collectives == "exchange" and dist.is_initialized() and dist.get_backend() != "gloo":
        raise ValueError(
            f"parallel.collectives=exchange runs on gloo only; this rank uses {dist.get_backend()}: "
            "use parallel.collectives=auto or native"
        )
    install_algorithm(None)  # torch.distributed's own collectives
    return NoTuning()


def rank_setup(cpu: bool, threads: int, cpu_affinity: str):
    """What each spawned rank runs first (``launch(..., rank_setup=...)``): on CPU, core binding and socket-thread
    bookkeeping (``gloo_cpu.RankSetup``); on GPU nothing."""
    return gloo_cpu.RankSetup(threads=threads, pin=cpu_affinity == "auto") if cpu else None


__all__ = ["NoTuning", "install", "rank_setup", "uses_gloo"]
