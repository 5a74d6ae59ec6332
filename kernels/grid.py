"""How every kernel in this package is launched: block sizes and warps from one place, and where Triton runs.

Triton decides when it is imported, and when each ``@triton.jit`` function is defined (its own ``tl.sum`` and
friends included), whether kernels are compiled for a GPU or run by its numpy interpreter
(``TRITON_INTERPRET=1``). A CPU-only build of torch can never run compiled kernels, so this module, which the
package imports before anything imports triton, turns the interpreter on for such builds (an explicit
``TRITON_INTERPRET`` setting wins). On a CUDA build without a GPU, set the variable yourself before the first
``import triton`` (the kernel tests' conftest does).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

if torch.version.cuda is None and torch.version.hip is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


class _TritonMissing:
    """Stands in for ``triton`` and ``triton.language`` where Triton has no wheels (macOS, Windows).

    Kernels can still be defined, so the torch references in the same files import and run; launching a kernel
    fails with one line. ``backend="auto"`` never picks Triton without CUDA, so only an explicit
    ``model.kernels=triton`` gets here.
    """

    def jit(self, fn=None, **_):
        def unavailable(*_, **__):
            raise RuntimeError("backend='triton' needs the triton package (Linux wheels); use model.kernels=torch")

        return unavailable if fn is not None else (lambda _fn: unavailable)

    def __getattr__(self, name: str):
        raise RuntimeError(f"triton.{name}: the triton package is not installed; use model.kernels=torch")


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on platforms without triton wheels
    triton = tl = _TritonMissing()

MAX_FUSED_SIZE = 65536 // 2  # widest row block one program holds in registers (fp32 elements)


def interpreting() -> bool:
    """True when Triton kernels run in the numpy interpreter (CPU tensors) rather than compiled (GPU).

    Asks triton itself: what counts is the setting when triton was first imported, not the variable now.
    """
    if isinstance(tl, _TritonMissing):
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def check_device(*tensors: torch.Tensor) -> None:
    """Fail with one clear line when a kernel is asked to run somewhere it cannot."""
    if isinstance(tl, _TritonMissing):
        raise RuntimeError("backend='triton' needs the triton package (Linux wheels); use model.kernels=torch")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"backend='triton' needs all tensors on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda" and interpreting():
        raise RuntimeError(
            "backend='triton' on CUDA tensors, but TRITON_INTERPRET=1 (the kernels were defined for CPU)"
        )
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "backend='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
            "first imported (importing modelpar_kernels first does it on CPU-only torch builds)"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"backend='triton' runs on CUDA (or CPU under TRITON_INTERPRET=1), not {device.type}")


def row_block(n_cols: int, max_block: int = MAX_FUSED_SIZE) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for kernels that give one program a whole row of ``n_cols`` elements.

    The block is the next power of two (tl.arange needs one); warps grow with it so each thread keeps a few
    elements in registers (the Liger-Kernel heuristic).
    """
    block = min(max_block, 1 << max(0, (n_cols - 1).bit_length()))
    if block >= 32768:
        num_warps = 32
    elif block >= 8192:
        num_warps = 16
    elif block >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    return block, num_warps


@dataclass(frozen=True)
class GpuTarget:
    """What the launch helpers need to know of the GPU a kernel is compiled for."""

    arch: int  # compute capability as 10 * major + minor: 80 (A100), 90 (H100, H200)
    sm_count: int


_compiling_for: GpuTarget | None = None


@contextlib.contextmanager
def compiling_for(target: GpuTarget):
    """Launch helpers pick the block sizes of ``target`` whatever device the tensors are on: how the ahead-of-time
    compiler (``modelpar_kernels.aot``) asks the real launch code what it would launch on a GPU it does not have."""
    global _compiling_for
    previous, _compiling_for = _compiling_for, target
    try:
        yield target
    finally:
        _compiling_for = previous


def gpu_target(device: torch.device) -> GpuTarget | None:
    """The GPU kernels for ``device`` are compiled for; None where they run in the interpreter."""
    if _compiling_for is not None:
        return _compiling_for
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return GpuTarget(10 * major + minor, torch.cuda.get_device_properties(device).multi_processor_count)


def program_count(device: torch.device, n_rows: int) -> int:
    """Programs for kernels that loop over rows and emit one partial sum each: one per SM on a GPU."""
    target = gpu_target(device)
    return min(n_rows, 4 if target is None else target.sm_count)


# Flash-attention tiles: q rows (BLOCK_M) x kv rows (BLOCK_N), warps and software-pipeline stages. Each kernel's
# candidates are what the ahead-of-time check compiles for every target; the defaults below pick one of them per
# (arch, head dim, dtype). "forward" needs BLOCK_M a multiple of BLOCK_N (its causal loop splits at a q-block
# boundary).
def _tile(m: int, n: int, warps: int, stages: int) -> dict[str, int]:
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages}


ATTENTION_CANDIDATES: dict[str, list[dict[str, int]]] = {
    "forward": [
        _tile(128, 64, 8, 2),
        _tile(128, 64, 4, 3),
        _tile(128, 32, 4, 2),
        _tile(64, 64, 4, 2),
        _tile(64, 32, 4, 2),
        _tile(32, 32, 4, 2),
    ],
    "backward_kv": [
        _tile(32, 128, 4, 2),
        _tile(32, 64, 8, 2),
        _tile(32, 64, 4, 2),
        _tile(16, 64, 4, 2),
        _tile(16, 32, 4, 2),
    ],
    "backward_q": [
        _tile(128, 32, 4, 2),
        _tile(64, 32, 8, 2),
        _tile(64, 32, 4, 2),
        _tile(32, 32, 4, 2),
        _tile(32, 16, 4, 2),
    ],
}
# fp32 holds twice the bytes per element in registers: on sm_90a even the smallest tiles above spill at head dims
# 128 and up (benchmarks/results/kernels_aot_sm90a_fp32.md), so fp32 there also tries these (on sm_80 the tiles
# above do not spill in fp32: benchmarks/results/kernels_aot_sm80.md)
FP32_CANDIDATES: dict[str, list[dict[str, int]]] = {
    "forward": [_tile(32, 16, 4, 2), _tile(16, 16, 4, 2)],
    "backward_kv": [_tile(16, 32, 4, 1), _tile(16, 16, 4, 2)],
    "backward_q": [_tile(16, 16, 4, 2)],
}
# The opt-in shared memory of one block (CUDA C Programming Guide, compute capabilities): sm_80 and sm_90.
SHARED_MEMORY_PER_BLOCK = {80: 166912, 90: 232448}


def attention_shared_estimate(kernel: str, tile: dict[str, int], block_d: int, block_dv: int, dtype) -> int:
    """Shared-memory bytes of one block, an upper bound from the tiles: the operand tiles the inner loop
    streams, ``num_stages`` buffers each, plus the tiles the block keeps resident. The forward streams K and V
    past its Q tile; dk/dv streams Q and dO past its K and V; dq streams K and V past its Q and dO. On the
    sm_80 and sm_90a tables it is within 0.97x-1.8x of what the compiler allocates (the 0.97 on tiles far below
    either limit)."""
    e = torch.empty((), dtype=dtype).element_size()
    m, n, s = tile["BLOCK_M"], tile["BLOCK_N"], tile["num_stages"]
    if kernel == "forward":
        return e * (s * n * (block_d + block_dv) + m * block_d)
    if kernel == "backward_kv":
        return e * (s * m * (block_d + block_dv) + n * (block_d + block_dv))
    return e * (s * n * (block_d + block_dv) + m * (block_d + block_dv))


def attention_candidates(kernel: str, block_d: int, block_dv: int, dtype, arch: int) -> list[dict[str, int]]:
    """The tiles of ``kernel`` worth compiling at these head-dim tiles, dtype and arch: every candidate whose
    shared-memory estimate fits one block. fp32 drops the largest ones at head dims 128 and up (they need more
    than sm_80's 163 KiB) and on sm_90a adds ``FP32_CANDIDATES``; bf16 keeps all but two forward tiles at sm_80's
    256 tile."""
    limit = SHARED_MEMORY_PER_BLOCK[90 if arch >= 90 else 80]
    small = FP32_CANDIDATES[kernel] if dtype == torch.float32 and arch >= 90 else []
    tiles = ATTENTION_CANDIDATES[kernel] + small
    return [t for t in tiles if attention_shared_estimate(kernel, t, block_d, block_dv, dtype) <= limit]


INTERPRETER_TILE = _tile(16, 16, 1, 1)  # small, so CPU tests cross several blocks and the masked tails


def attention_blocks(head_dim: int, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """Tiles for flash attention per kernel ("forward", "backward_kv", "backward_q"), for the GPU ``device`` is
    (or the one being compiled for); see ``ATTENTION_CANDIDATES``."""
    target = gpu_target(device)
    if target is None:
        return {"forward": INTERPRETER_TILE, "backward_kv": INTERPRETER_TILE, "backward_q": INTERPRETER_TILE}
    return attention_defaults(head_dim, dtype, target.arch)


def attention_defaults(head_dim: int, dtype: torch.dtype, arch: int) -> dict[str, dict[str, int]]:
    """The default tiles of each attention kernel on ``arch``, one of ``ATTENTION_CANDIDATES`` each."""
    # Chosen from the ahead-of-time tables (benchmarks/results/kernels_aot.md: sm_90a bf16; kernels_aot_sm80.md:
    # sm_80, both dtypes, every candidate): the largest candidate that neither spills nor overflows shared memory
    # in any variant (documents, windows, cp blocks) at the head dim's tile. On sm_90a at head dim 64 the earlier
    # forward (128 x 64, 4 warps, 3 stages) and dk/dv (32 x 128, 4 warps) tiles reached 255 registers and spilled
    # 40 and up to 128 bytes per thread; 8 warps on 128 x 64 and 32 x 64 keep them at 128 and 123. On sm_80 at
    # head dim 128 the 128 x 64 forward spilled 8 bytes with documents and a window: 64 x 64 there. fp32 (the
    # tests' dtype on a GPU) needs twice the registers and shared memory of bf16: its 128 x 64 forward spilled
    # up to 11 KB per thread on sm_80 and its larger backward tiles overflowed 163 KiB. On sm_90a (wgmma's
    # operand layouts) those fp32 tiles spilled 8-8,016 bytes in 71 of 164 defaults: there fp32 takes the tiles of
    # the sm_90a fp32 table that spill in no variant, ``FP32_CANDIDATES`` at head dims 128 and up.
    c = ATTENTION_CANDIDATES
    if dtype == torch.float32 and arch >= 90:  # (forward, dk/dv, dq) up to head dims 64, 128 and beyond
        small = FP32_CANDIDATES
        tiers = [
            (c["forward"][5], small["backward_kv"][1], c["backward_q"][3]),
            (small["forward"][0], small["backward_kv"][0], c["backward_q"][3]),
            (small["forward"][1], small["backward_kv"][1], small["backward_q"][0]),
        ]
        forward, kv, q = tiers[0 if head_dim <= 64 else 1 if head_dim <= 128 else 2]
        return {"forward": forward, "backward_kv": kv, "backward_q": q}
    if dtype == torch.float32:
        kv, q = (1, 1) if head_dim <= 64 else (4, 1) if head_dim <= 128 else (4, 4)
        return {"forward": c["forward"][5], "backward_kv": c["backward_kv"][kv], "backward_q": c["backward_q"][q]}
    if head_dim > 128:  # multi-head latent attention's 192 (a 256 tile): 32 x 64 dk/dv spilled 8-16 bytes
        return {"forward": c["forward"][0], "backward_kv": c["backward_kv"][4], "backward_q": c["backward_q"][1]}
    if head_dim <= 64:
        return {"forward": c["forward"][0], "backward_kv": c["backward_kv"][1], "backward_q": c["backward_q"][0]}
    forward = c["forward"][3] if arch < 90 else c["forward"][0]
    return {"forward": forward, "backward_kv": c["backward_kv"][1], "backward_q": c["backward_q"][1]}
