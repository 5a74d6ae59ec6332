"""Kernel micro-benchmarks on one CUDA GPU: the Triton kernels of ``modelpar_kernels`` against torch eager (the
torch references), torch.compile, and Liger-Kernel / flash-attn when they are importable.

    python benchmarks/kernels.py                 # full run, bf16, about 3-6 minutes on one H100/H200
    python benchmarks/kernels.py --no-compile    # skip the torch.compile baselines (they dominate start-up)
    python benchmarks/kernels.py --smoke         # tiny shapes, every code path once, any device (CI / CPU)

Needs a CUDA device: without one (and without --smoke) it prints one line and exits with status 2.

For each op it times forward and forward+backward with ``triton.testing.do_bench`` (median), and reports
- memory-bound ops (RMSNorm, RoPE, SwiGLU, cross-entropy): GB/s of the bytes the op must move at least, and
  that as a fraction of the device-to-device copy bandwidth measured at start-up;
- attention: TFLOP/s (causal forward = 2 * 2 * b * hq * s^2 * d / 2, backward = 2.5x forward);
- peak memory of one forward+backward beyond the inputs, and the largest relative difference from eager.
Results: a table on stdout, ``benchmarks/results/kernels.json`` and ``kernels.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# modelpar_kernels before triton: on a CPU-only torch it turns on Triton's interpreter (for --smoke).
import modelpar_kernels as mk
import torch
import torch.nn.functional as F
import triton
import triton.testing
from modelpar_kernels.attention import attention_reference
from modelpar_kernels.rope import apply_rope_reference

NEEDS_CUDA = "benchmarks/kernels.py needs a CUDA device (none found); run it on a GPU machine, or pass --smoke"


@dataclass
class Op:
    """One benchmarked op: how to make inputs, and each implementation as ``fn(*inputs) -> output``."""

    name: str
    shape: str
    make_inputs: Callable[[], tuple]
    impls: dict[str, Callable]
    bytes_fwd: int = 0  # least bytes moved by forward / forward+backward (memory-bound ops)
    bytes_fwd_bwd: int = 0
    flops_fwd: float = 0.0  # for compute-bound ops
    flops_fwd_bwd: float = 0.0
    differentiable: tuple[int, ...] = ()  # indices of inputs that get gradients


@dataclass
class Row:
    op: str
    shape: str
    pass_: str
    impl: str
    ms: float | None = None
    gb_s: float | None = None
    copy_fraction: float | None = None
    tflop_s: float | None = None
    peak_mib: float | None = None
    max_rel_diff: float | None = None
    speedup_vs_eager: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)


# -- implementations ---------------------------------------------------------------------------------------


def _peers() -> dict[str, object]:
    """Optional peer libraries, imported only if present."""
    found = {}
    try:
        import liger_kernel.transformers as liger

        found["liger"] = liger
    except ImportError:
        pass
    try:
        import flash_attn

        found["flash_attn"] = flash_attn
    except ImportError:
        pass
    return found


@dataclass(frozen=True)
class Setting:
    """What every op builder needs: where to run, in which dtype, which baselines exist."""

    device: str
    dtype: torch.dtype
    smoke: bool
    compile_baselines: bool
    liger: object | None
    flash_attn: object | None
    compile_backend: str = "inductor"

    def randn(self, *shape, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        x = scale * torch.randn(*shape, device=self.device, dtype=self.dtype) + offset
        return x.requires_grad_()

    def compiled(self, fn: Callable) -> Callable | None:
        return torch.compile(fn, dynamic=False, backend=self.compile_backend) if self.compile_baselines else None

    @property
    def element_size(self) -> int:
        return torch.finfo(self.dtype).bits // 8


def rms_norm_ops(c: Setting) -> list[Op]:
    n, h = (37, 96) if c.smoke else (16384, 4096)
    el = c.element_size

    def inputs():
        return c.randn(n, h), c.randn(h, scale=0.1, offset=1.0)

    return [
        Op(
            "rms_norm",
            f"[{n}, {h}]",
            inputs,
            {
                "triton": lambda x, w: mk.rms_norm(x, w, 1e-5, backend="triton"),
                "eager": lambda x, w: mk.rms_norm(x, w, 1e-5, backend="torch"),
                "compile": c.compiled(lambda x, w: mk.rms_norm(x, w, 1e-5, backend="torch")),
                "liger": (lambda x, w: _liger_rms_norm(c.liger, x, w)) if c.liger else None,
            },
            bytes_fwd=2 * n * h * el,  # read x, write y
            bytes_fwd_bwd=5 * n * h * el,  # + read x, dy, write dx
            differentiable=(0, 1),
        )
    ]


def rope_ops(c: Setting) -> list[Op]:
    b, s, hq, d = (3, 13, 4, 32) if c.smoke else (4, 4096, 32, 128)
    cos, sin = mk.rope_tables(s, d, 500000.0, device=c.device)
    return [
        Op(
            "rope",
            f"q [{b}, {s}, {hq}, {d}]",
            lambda: (c.randn(b, s, hq, d),),
            {
                "triton": lambda q: mk.apply_rope(q, cos, sin, backend="triton"),
                "eager": lambda q: apply_rope_reference(q, cos, sin),
                "compile": c.compiled(lambda q: apply_rope_reference(q, cos, sin)),
                "liger": (lambda q: _liger_rope(c.liger, q, cos, sin)) if c.liger else None,
            },
            bytes_fwd=2 * b * s * hq * d * c.element_size,
            bytes_fwd_bwd=4 * b * s * hq * d * c.element_size,
            differentiable=(0,),
        )
    ]


def swiglu_ops(c: Setting) -> list[Op]:
    n, f = (37, 80) if c.smoke else (16384, 14336)
    return [
        Op(
            "swiglu",
            f"[{n}, {f}]",
            lambda: (c.randn(n, f), c.randn(n, f)),
            {
                "triton": lambda g, u: mk.swiglu(g, u, backend="triton"),
                "eager": lambda g, u: mk.swiglu(g, u, backend="torch"),
                "compile": c.compiled(lambda g, u: mk.swiglu(g, u, backend="torch")),
                "liger": _liger_swiglu if c.liger else None,
            },
            bytes_fwd=3 * n * f * c.element_size,  # read gate, up, write out
            bytes_fwd_bwd=8 * n * f * c.element_size,  # + read gate, up, dout, write dgate, dup
            differentiable=(0, 1),
        )
    ]


def attention_ops(c: Setting) -> list[Op]:
    shapes = [(2, 37, 4, 2, 32)] if c.smoke else [(4, 4096, 32, 8, 128), (4, 4096, 32, 8, 64)]
    fa = c.flash_attn
    ops = []
    for b, s, hq, hkv, d in shapes:
        flops = 2 * 2 * b * hq * s * s * d / 2

        def qkv(b=b, s=s, hq=hq, hkv=hkv, d=d):
            return c.randn(b, s, hq, d), c.randn(b, s, hkv, d), c.randn(b, s, hkv, d)

        ops.append(
            Op(
                "attention",
                f"b{b} s{s} hq{hq} hkv{hkv} d{d}",
                qkv,
                {
                    "triton": lambda q, k, v: mk.attention(q, k, v, backend="triton"),
                    "eager": lambda q, k, v: attention_reference(q, k, v),
                    "compile": c.compiled(lambda q, k, v: attention_reference(q, k, v)),
                    "flash-attn": (lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True)) if fa else None,
                },
                flops_fwd=flops,
                flops_fwd_bwd=3.5 * flops,  # backward does 2.5x the forward's matmul work
                differentiable=(0, 1, 2),
            )
        )
    return ops


def cross_entropy_ops(c: Setting) -> list[Op]:
    """tp=1. The Triton path (like Liger's) consumes its logits; every implementation gets fresh inputs."""
    n, v = (37, 100) if c.smoke else (8192, 128256)
    liger = c.liger
    return [
        Op(
            "cross_entropy",
            f"[{n}, {v}]",
            lambda: (c.randn(n, v, scale=2.0), torch.randint(0, v, (n,), device=c.device)),
            {
                "triton": lambda x, t: mk.vocab_parallel_cross_entropy(x, t, backend="triton"),
                "eager": lambda x, t: mk.vocab_parallel_cross_entropy(x, t, backend="torch"),
                "compile": c.compiled(lambda x, t: F.cross_entropy(x.float(), t)),
                "liger": (lambda x, t: liger.LigerCrossEntropyLoss()(x, t)) if liger else None,
            },
            bytes_fwd=n * v * c.element_size,  # read the logits once (ours reads twice and writes the gradient)
            bytes_fwd_bwd=2 * n * v * c.element_size,  # + write the gradient
            differentiable=(0,),
        )
    ]


OP_BUILDERS = {
    "rms_norm": rms_norm_ops,
    "rope": rope_ops,
    "swiglu": swiglu_ops,
    "attention": attention_ops,
    "cross_entropy": cross_entropy_ops,
}


def _liger_rms_norm(liger, x, w):
    norm = liger.LigerRMSNorm(x.shape[-1], eps=1e-5).to(device=x.device, dtype=x.dtype)
    norm.weight = torch.nn.Parameter(w.detach())
    return norm(x)


def _liger_rope(liger, q, cos, sin):
    # Liger takes [b, h, s, d], [1, s, d] full-width tables, and rotates q and k together (k is a throwaway here).
    q = q.transpose(1, 2)
    cos2, sin2 = (torch.cat((t, t), -1)[None].to(q.dtype) for t in (cos, sin))
    return liger.liger_rotary_pos_emb(q, q[:, :1].detach().clone(), cos2, sin2)[0].transpose(1, 2)


def _liger_swiglu(g, u):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(g, u)


# -- measuring ---------------------------------------------------------------------------------------------


def copy_bandwidth(device: str, smoke: bool) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write)."""
    n = 1 << (16 if smoke else 28)
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), smoke)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def time_ms(fn: Callable, smoke: bool) -> float:
    if smoke:  # every code path once; the number means nothing
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _outputs(out) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(o) and o.requires_grad]


def _fwd_bwd(fn, inputs, differentiable):
    outs = _outputs(fn(*inputs))
    grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]
    return torch.autograd.grad(outs, [inputs[i] for i in differentiable], grads)


def _peak_mib(run: Callable, device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _max_rel_diff(a, b) -> float | None:
    a, b = (t if torch.is_tensor(t) else t[0] for t in (a, b))
    if a.shape != b.shape:
        return None
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def measure(op: Op, copy_gb_s: float, device: str, smoke: bool) -> list[Row]:
    """Every implementation on the same inputs, made afresh for each (some consume theirs, as the loss does)."""

    def fresh_inputs():
        torch.manual_seed(0)
        return op.make_inputs()

    rows = []
    reference = op.impls["eager"](*fresh_inputs())
    for pass_ in ("fwd", "fwd+bwd"):
        for impl, fn in op.impls.items():
            if fn is None:
                continue
            row = Row(op.name, op.shape, pass_, impl)
            inputs = fresh_inputs()
            try:
                if pass_ == "fwd":
                    row.max_rel_diff = _max_rel_diff(fn(*inputs), reference)
                    run = lambda fn=fn, inputs=inputs: fn(*inputs)
                else:
                    run = lambda fn=fn, inputs=inputs: _fwd_bwd(fn, inputs, op.differentiable)
                row.ms = time_ms(run, smoke)
                row.peak_mib = _peak_mib(run, device)
            except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
                message = str(exc).splitlines()[0][:120] if str(exc) else ""
                row.error = f"{type(exc).__name__}: {message}"
            else:
                nbytes = op.bytes_fwd if pass_ == "fwd" else op.bytes_fwd_bwd
                flops = op.flops_fwd if pass_ == "fwd" else op.flops_fwd_bwd
                if nbytes:
                    row.gb_s = nbytes / row.ms / 1e6
                    row.copy_fraction = row.gb_s / copy_gb_s
                if flops:
                    row.tflop_s = flops / row.ms / 1e9
            rows.append(row)
            del inputs
    for row in rows:
        eager = next(r for r in rows if r.pass_ == row.pass_ and r.impl == "eager")
        if row.ms and eager.ms:
            row.speedup_vs_eager = eager.ms / row.ms
    return rows


# -- reporting ---------------------------------------------------------------------------------------------

COLUMNS = [
    ("op", "op"),
    ("shape", "shape"),
    ("pass", "pass_"),
    ("impl", "impl"),
    ("ms", "ms"),
    ("GB/s", "gb_s"),
    ("% copy BW", "copy_fraction"),
    ("TFLOP/s", "tflop_s"),
    ("peak MiB", "peak_mib"),
    ("x eager", "speedup_vs_eager"),
    ("max rel diff", "max_rel_diff"),
]


def _cell(row: Row, key: str) -> str:
    value = getattr(row, key)
    if row.error and key == "ms":
        return row.error
    if value is None:
        return ""
    if key == "copy_fraction":
        return f"{100 * value:.0f}%"
    if key == "max_rel_diff":
        return f"{value:.1e}"
    if isinstance(value, float):
        return f"{value:.3g}" if value < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, key) for _, key in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def environment(device: str, copy_gb_s: float, dtype: torch.dtype) -> dict:
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu"
    return {
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "peers": sorted(_peers()),
        "copy_gb_s": copy_gb_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="results folder")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, each path once (works on CPU)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(OP_BUILDERS)}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.only.split(",") if name and name not in OP_BUILDERS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a kernel; choose from {', '.join(OP_BUILDERS)}")

    if not torch.cuda.is_available() and not args.smoke:
        print(NEEDS_CUDA, file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter has no bf16 arithmetic
    torch.manual_seed(0)
    started = time.perf_counter()
    copy_gb_s = copy_bandwidth(device, args.smoke)
    env = environment(device, copy_gb_s, dtype)
    print(f"{env['device']}: copy bandwidth {copy_gb_s:.0f} GB/s; peers: {', '.join(env['peers']) or 'none'}")

    peers = _peers()
    setting = Setting(
        device,
        dtype,
        args.smoke,
        compile_baselines=not args.no_compile and not args.smoke,
        liger=peers.get("liger"),
        flash_attn=peers.get("flash_attn"),
    )
    rows = []
    only = [name for name in args.only.split(",") if name] or list(OP_BUILDERS)
    for name in only:
        for op in OP_BUILDERS[name](setting):
            op_rows = measure(op, copy_gb_s, device, args.smoke)
            print(markdown_table(op_rows).split("\n", 2)[2], flush=True)
            rows += op_rows
            if device == "cuda":
                torch.cuda.empty_cache()

    env["seconds"] = round(time.perf_counter() - started, 1)
    table = markdown_table(rows)
    print(f"\n{table}\n\n{env['seconds']} s")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "kernels-smoke" if args.smoke else "kernels"
    payload = {"environment": env, "rows": [_json_row(r) for r in rows]}
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    notes = (
        f"# Kernel micro-benchmarks\n\n{env['device']}, {env['dtype']}, torch {env['torch']}, triton {env['triton']}, "
        f"peers: {', '.join(env['peers']) or 'none'}. Copy bandwidth {copy_gb_s:.0f} GB/s. "
        "Median of `triton.testing.do_bench`; GB/s counts the least bytes each op must move.\n\n"
    )
    (args.out / f"{stem}.md").write_text(notes + table + "\n")
    print(f"wrote {args.out / stem}.json and .md")
    return 0


def _json_row(row: Row) -> dict:
    out = asdict(row)
    out["pass"] = out.pop("pass_")
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


if __name__ == "__main__":
    sys.exit(main())
