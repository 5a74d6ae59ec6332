"""The planner's presets: hardware (accelerators and their links, and this project's CPU machine) and the model
shapes of ``recipes/model/*.yaml``, read through the model's own schema as the trainer reads them."""

from __future__ import annotations

import importlib.resources
import pathlib

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from modelpar.model.config import ModelConfig
from modelpar.plan.spec import GIB, Hardware, ModelSpec, PlanError

RECIPES = str(importlib.resources.files("modelpar_recipes"))
MODEL_PRESET_DIR = pathlib.Path(RECIPES) / "model"

HARDWARE = {
    # A100 SXM 80GB: 312 TFLOP/s dense bf16; NVLink3 12 links x 25 GB/s per direction; DGX A100 has one
    # 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s).
    # Host link for offload: PCIe 4.0 x16 (~25 GB/s per direction) on A100, PCIe 5.0 x16 (~50 GB/s) on H100/H200.
    "a100-80gb": Hardware(
        "a100-80gb", 312e12, 80 * GIB, 300e9, 25e9, 8, 3e-6, memory_bw=2.0e12, host_bw=25e9, fp32_peak_flops=19.5e12
    ),
    # Latency: ~3 us per ring step (NCCL's low-latency protocol), so an 8-GPU all-reduce starts at ~40 us.
    # H100 SXM: 989 TFLOP/s dense bf16; NVLink4 18 links x 25 GB/s; one 400 Gb/s NDR NIC per GPU (50 GB/s).
    # HBM: A100 80GB 2.0 TB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s. Dense FP8 on H100/H200: 1979 TFLOP/s, twice
    # bf16 (the A100 has none). Dense fp32 without tensor cores: A100 19.5, H100 SXM / H200 67 TFLOP/s.
    "h100-80gb": Hardware(
        "h100-80gb",
        989e12,
        80 * GIB,
        450e9,
        50e9,
        8,
        3e-6,
        memory_bw=3.35e12,
        host_bw=50e9,
        fp8_peak_flops=1979e12,
        fp32_peak_flops=67e12,
    ),
    "h200": Hardware(
        "h200",
        989e12,
        140 * GIB,
        450e9,
        50e9,
        8,
        3e-6,
        memory_bw=4.8e12,
        host_bw=50e9,
        fp8_peak_flops=1979e12,
        fp32_peak_flops=67e12,
    ),
    # This project's CPU machine, one thread per rank: torch fp32 matmul measured ~90-98 GFLOP/s on one
    # AMD EPYC core; gloo over loopback moves ~1 GB/s with ~0.25 ms per message (2 MB all-reduce ~4 ms,
    # send+recv round trip ~3.5 ms); element-wise ops on [256, 256] fp32 ~10 GB/s with dispatch;
    # 2 cores. Rough: benchmarks/plan_vs_measured.py calibrates all of these in the run it compares.
    "cpu": Hardware(
        "cpu",
        100e9,
        8 * GIB,
        1e9,
        1e9,
        2,
        250e-6,
        reserved_bytes=0.5 * GIB,
        dtype="fp32",
        memory_bw=10e9,
        compute_units=2,
        kernels="torch",
    ),
}


def model_presets() -> list[str]:
    return sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.yaml"))


def load_model(name: str) -> ModelSpec:
    """A model preset, ``recipes/model/<name>.yaml``, read through the model's schema (``ModelConfig``) as the
    trainer reads it: an unknown field or a value of the wrong type is refused (``PlanError``, one line)."""
    path = MODEL_PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise PlanError(f"unknown model preset {name!r}; choose one of {', '.join(model_presets())}")
    try:
        shape = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))
    except OmegaConfBaseException as exc:
        # OmegaConf's message: the complaint (the field, its value or type), then its key and the schema's type
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        problem = ", ".join(line for line in lines if not line.startswith(("reference_type", "object_type")))
        raise PlanError(f"model preset {name!r} (recipes/model/{name}.yaml): {problem or str(exc)}") from None
    return ModelSpec(shape)


def load_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise PlanError(f"unknown hardware preset {name!r}; choose one of {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name]
