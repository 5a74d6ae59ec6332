"""How every kernel in this package is launched: block sizes and warps from one place, and where Triton runs.

Triton decides when it is imported, and when each ``@triton.jit`` function is defined (its own ``tl.sum`` and
friends included), whether kernels are compiled for a GPU or run by its numpy interpreter
(``TRITON_INTERPRET=1``). A CPU-only build of torch can never run compiled kernels, so this module, which the
package imports before anything imports triton, turns the interpreter on for such builds (an explicit
``TRITON_INTERPRET`` setting wins). On a CUDA build without a GPU, set the variable yourself before the first
``import triton`` (the kernel tests' conftest does).
"""

from __future__ import annotations

import os

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


def program_count(device: torch.device, n_rows: int) -> int:
    """Programs for kernels that loop over rows and emit one partial sum each: one per SM on a GPU."""
    if device.type == "cuda":
        return min(n_rows, torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 4)


def attention_blocks(head_dim: int, device: torch.device) -> dict[str, dict[str, int]]:
    """Tiles for flash attention: q rows (BLOCK_M) x kv rows (BLOCK_N), warps and pipeline stages, per kernel.

    "forward" needs BLOCK_M a multiple of BLOCK_N (its causal loop splits at a q-block boundary). Small tiles
    under the interpreter, so CPU tests cross several blocks and the masked tails.
    """
    if device.type != "cuda":
        tile = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
        return {"forward": tile, "backward_kv": tile, "backward_q": tile}
    if head_dim <= 64:
        return {
            "forward": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
            "backward_kv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
            "backward_q": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        }
    return {
        "forward": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        "backward_kv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        "backward_q": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    }
