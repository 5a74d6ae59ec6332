"""The floor under each kernel: bytes it must move and FLOPs it must do per call, at the presets' widths.

A kernel cannot finish sooner than ``max(bytes / HBM bandwidth, FLOPs / dense bf16 peak)`` on a GPU. Bytes count
each tensor the op reads or writes once (what a kernel that keeps its working set on chip moves; L2 hits are not
credited beyond that), at 2 bytes an element (bf16), fp32 for the per-row statistics. FLOPs count multiply-adds
as two; attention counts its matmuls only (causal: half the score matrix), backward 2.5x the forward (it
recomputes the scores and does four more matmuls of the same size).

Figures used (NVIDIA datasheets, SXM parts): H100 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 tensor core; H200
4.8 TB/s HBM3e, the same compute. One call is one micro-batch of ``TOKENS`` tokens (batch 1 x sequence 8192) of
one layer at tp 1; under tp the sharded ops (RoPE, SwiGLU, attention, cross-entropy) move and compute 1/tp of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar_kernels.presets import PRESETS


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float


HARDWARE = {
    "H100": Hardware("H100 SXM", 3.35e12, 989e12),
    "H200": Hardware("H200 SXM", 4.8e12, 989e12),
}
TOKENS = 8192
BF16, FP32 = 2, 4


def floor_s(nbytes: float, flops: float, hardware: Hardware) -> float:
    """The least time of a call moving ``nbytes`` and doing ``flops`` on ``hardware``."""
    return max(nbytes / hardware.hbm_bytes_per_s, flops / hardware.bf16_flops_per_s)


def hardware_for(device_name: str) -> Hardware | None:
    """The figures for a CUDA device name ("NVIDIA H100 80GB HBM3", "NVIDIA H200"), None if not listed."""
    return next((hw for key, hw in HARDWARE.items() if key in device_name), None)


def kernel_costs(hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, tokens: int = TOKENS):
    """(op, pass, shape, bytes, flops) of every fused op of one layer (cross-entropy: of the head) per call."""
    t, h, d = tokens, hidden, hidden // heads
    qk = t * (heads + kv_heads) * d
    attn_flops = 2 * 2 * t * t * heads * d / 2  # QK^T and PV, causal half
    q_bytes, kv_bytes = t * heads * d * BF16, 2 * t * kv_heads * d * BF16
    return [
        ("rms_norm", "fwd", f"[{t}, {h}]", 2 * t * h * BF16 + h * BF16 + t * FP32, 4 * t * h),
        ("rms_norm", "bwd", f"[{t}, {h}]", 3 * t * h * BF16 + h * BF16 + t * FP32, 8 * t * h),
        ("rope", "fwd", f"q+k [{t}, {heads}+{kv_heads}, {d}]", 2 * qk * BF16 + t * d * FP32, 3 * qk),
        ("rope", "bwd", f"q+k [{t}, {heads}+{kv_heads}, {d}]", 2 * qk * BF16 + t * d * FP32, 3 * qk),
        ("swiglu", "fwd", f"[{t}, {ffn}]", 3 * t * ffn * BF16, 6 * t * ffn),
        ("swiglu", "bwd", f"[{t}, {ffn}]", 5 * t * ffn * BF16, 12 * t * ffn),
        # stats pass reads the logits, the gradient pass reads them again and writes the gradient over them
        ("cross_entropy", "fwd", f"[{t}, {vocab}]", 3 * t * vocab * BF16, 6 * t * vocab),
        (
            "attention",
            "fwd",
            f"s{t} hq{heads} hkv{kv_heads} d{d}",
            2 * q_bytes + kv_bytes + t * heads * FP32,
            attn_flops,
        ),
        (
            "attention",
            "bwd",
            f"s{t} hq{heads} hkv{kv_heads} d{d}",
            4 * q_bytes + 2 * kv_bytes + 2 * t * heads * FP32,
            2.5 * attn_flops,
        ),
    ]


def roofline_rows() -> list[dict]:
    """One row per preset, op and pass: bytes, FLOPs, intensity and the floor on each listed GPU."""
    rows = []
    for preset, p in PRESETS.items():
        widths = (p.hidden, p.heads, p.kv_heads, p.ffn_hidden, p.vocab_size)
        for op, pass_, shape, nbytes, flops in kernel_costs(*widths):
            row = {"preset": preset, "op": op, "pass": pass_, "shape": shape, "bytes": int(nbytes), "flops": flops}
            row["flops_per_byte"] = flops / nbytes
            for key, hw in HARDWARE.items():
                row[f"floor_us_{key}"] = floor_s(nbytes, flops, hw) * 1e6
            h100 = HARDWARE["H100"]
            row["bound"] = "compute" if flops / h100.bf16_flops_per_s > nbytes / h100.hbm_bytes_per_s else "memory"
            rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "## Roofline: what each kernel must reach",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        __doc__.split("\n\n")[2].replace("\n", " "),
        "",
        "| preset | op | pass | shape | MB | GFLOP | FLOP/B | bound | floor H100 us | floor H200 us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['op']} | {r['pass']} | {r['shape']} | {r['bytes'] / 1e6:.1f} "
            f"| {r['flops'] / 1e9:.2f} | {r['flops_per_byte']:.1f} | {r['bound']} "
            f"| {r['floor_us_H100']:.1f} | {r['floor_us_H200']:.1f} |"
        )
    return "\n".join(lines)
